//! The agent's certificate authorities, behind `tether_manager::CertificateAuthority`:
//! the operator's CA read from `cert_file` and `key_file` (`provider = "file"`), or a CA the
//! agent makes once in its data dir and reuses (`provider = "dev"`), with the extra `roots`
//! trusted beside either.
//!
//! Everything that can be wrong with the files is found here, when the CA is loaded (at the
//! agent's start and at each reload), and named with the config file and the field: what a
//! leaf needs later is only the key in memory. Keys are ECDSA P-256. A private key's text
//! is never put in an error or a log line.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, PKCS_ECDSA_P256_SHA256, PublicKeyData, SanType, SerialNumber,
};
use tether_manager::{CaError, CertificateAuthority};
use tether_state::config::DisplayPath;
use tether_state::persist::{DataDir, Durability, PersistError};
use tether_state::{CaProvider, CaRoot, ConnectConfig, IssuedLeaf, LeafRequest, PemPath, PrivateKeyPem};
use x509_parser::certificate::X509Certificate;
use x509_parser::pem::Pem;

/// The dev CA's directory in the data dir, and its files there.
pub(crate) const DEV_DIR: &str = "connect";
pub(crate) const DEV_CERT: &str = "ca.pem";
pub(crate) const DEV_KEY: &str = "ca-key.pem";

/// How long the dev CA is valid: ten years, since nothing rotates it.
const DEV_CA_LIFE: Duration = Duration::from_secs(10 * 365 * 24 * 3600);

/// How far back a leaf's validity starts, for clocks that are a little behind.
const BACKDATE: Duration = Duration::from_secs(60);

/// Why a CA could not be loaded. Each names the config file with the `[connect]` table and
/// the field whose file is at fault.
#[derive(Debug, thiserror::Error)]
pub(crate) enum CaLoadError {
    /// A file could not be read.
    #[error("{}: field `connect.ca.{field}`: cannot read {}", DisplayPath(config), DisplayPath(path))]
    Read {
        config: PathBuf,
        field: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A file was read, and is not what the field needs.
    #[error("{}: field `connect.ca.{field}`: {}: {problem}", DisplayPath(config), DisplayPath(path))]
    Invalid { config: PathBuf, field: &'static str, path: PathBuf, problem: String },
    /// The dev CA could not be written to, or read from, the data dir.
    #[error("cannot keep the dev CA in {}", DisplayPath(dir))]
    DevStore {
        dir: PathBuf,
        #[source]
        source: PersistError,
    },
    /// A provider that this agent cannot run.
    #[error("{}: field `connect.ca.provider`: this agent has no provider {provider:?}", DisplayPath(config))]
    Unsupported { config: PathBuf, provider: &'static str },
    /// The dev CA could not be made.
    #[error("cannot make the dev CA")]
    DevMake(#[source] rcgen::Error),
}

/// A loaded certificate authority: the key that signs, its certificate's name, and every
/// root the mesh trusts (the CA's own first).
pub(crate) struct Authority {
    issuer: Issuer<'static, KeyPair>,
    roots: Vec<CaRoot>,
}

impl std::fmt::Debug for Authority {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Authority").field("roots", &self.roots).finish_non_exhaustive()
    }
}

/// Where a check's error points: the config file and the field.
struct Field<'a> {
    config: &'a Path,
    name: &'static str,
}

impl Field<'_> {
    fn invalid(&self, path: &Path, problem: impl Into<String>) -> CaLoadError {
        CaLoadError::Invalid {
            config: self.config.to_owned(),
            field: self.name,
            path: path.to_owned(),
            problem: problem.into(),
        }
    }

    fn read(&self, path: &Path) -> Result<Vec<u8>, CaLoadError> {
        std::fs::read(path).map_err(|source| CaLoadError::Read {
            config: self.config.to_owned(),
            field: self.name,
            path: path.to_owned(),
            source,
        })
    }
}

impl Authority {
    /// Loads the CA that `connect` describes; `config` is the file that holds the table, for
    /// the errors. The dev CA is made in `data` the first time and read back afterwards.
    ///
    /// # Errors
    ///
    /// [`CaLoadError`], naming the file and the field.
    pub(crate) fn load(connect: &ConnectConfig, config: &Path, data: &DataDir) -> Result<Self, CaLoadError> {
        let mut authority = match &connect.ca.provider {
            CaProvider::File { cert_file, key_file } => {
                let cert = Field { config, name: "cert_file" };
                let key = Field { config, name: "key_file" };
                let key_pem = read_private_key(&key, key_file.as_path())?;
                let cert_pem = cert.read(cert_file.as_path())?;
                Self::from_pem(&cert, cert_file.as_path(), &cert_pem, &key, key_file.as_path(), &key_pem)?
            }
            CaProvider::Dev => Self::dev(config, data, connect)?,
            other => {
                return Err(CaLoadError::Unsupported { config: config.to_owned(), provider: other.name() });
            }
        };
        let roots = Field { config, name: "roots" };
        for path in &connect.ca.roots {
            authority.trust(&roots, path)?;
        }
        Ok(authority)
    }

    /// The CA from its certificate and key, checked: one CA certificate, valid now, a PKCS #8
    /// key that matches it.
    fn from_pem(
        cert_field: &Field<'_>,
        cert_path: &Path,
        cert_pem: &[u8],
        key_field: &Field<'_>,
        key_path: &Path,
        key_pem: &str,
    ) -> Result<Self, CaLoadError> {
        let pems = read_pems(cert_field, cert_path, cert_pem)?;
        let [pem] = pems.as_slice() else {
            return Err(cert_field.invalid(
                cert_path,
                format!(
                    "holds {} certificates: it must hold the CA certificate alone (put other roots in `roots`)",
                    pems.len()
                ),
            ));
        };
        let cert = parse_ca(cert_field, cert_path, pem)?;
        let key = KeyPair::from_pem(key_pem).map_err(|err| {
            let hint = if key_pem.contains("BEGIN EC PRIVATE KEY") || key_pem.contains("BEGIN RSA PRIVATE KEY") {
                " (it must be PKCS #8, `BEGIN PRIVATE KEY`: `openssl pkcs8 -topk8 -nocrypt` converts it)"
            } else {
                ""
            };
            key_field.invalid(key_path, format!("not a usable PEM private key: {err}{hint}"))
        })?;
        if key.der_bytes() != cert.public_key().subject_public_key.data.as_ref() {
            return Err(key_field.invalid(
                key_path,
                format!("the key does not match the certificate of `cert_file` ({})", DisplayPath(cert_path)),
            ));
        }
        let root = root_of(&cert, pem, true);
        let issuer = Issuer::from_ca_cert_der(&pem.contents.clone().into(), key)
            .map_err(|err| cert_field.invalid(cert_path, format!("cannot sign with it: {err}")))?;
        Ok(Self { issuer, roots: vec![root] })
    }

    /// Trusts the certificates of the `roots` file `path` beside the CA's own.
    fn trust(&mut self, field: &Field<'_>, path: &PemPath) -> Result<(), CaLoadError> {
        let path = path.as_path();
        let text = field.read(path)?;
        let pems = read_pems(field, path, &text)?;
        if pems.is_empty() {
            return Err(field.invalid(path, "holds no certificate"));
        }
        for pem in &pems {
            let cert = parse_ca(field, path, pem)?;
            let root = root_of(&cert, pem, false);
            if !self.roots.iter().any(|known| known.cert_pem == root.cert_pem) {
                self.roots.push(root);
            }
        }
        Ok(())
    }

    /// The dev CA of `data`: read back, or made and written (key first, both 0600, kept
    /// across power loss: leaves already handed out chain to it).
    fn dev(config: &Path, data: &DataDir, connect: &ConnectConfig) -> Result<Self, CaLoadError> {
        let dir = data
            .root_dir()
            .subdir(DEV_DIR)
            .map_err(|source| CaLoadError::DevStore { dir: data.root().join(DEV_DIR), source })?;
        let store_error = |source| CaLoadError::DevStore { dir: dir.path().to_owned(), source };
        let cert = dir.read(DEV_CERT).map_err(store_error)?;
        let key = dir.read(DEV_KEY).map_err(store_error)?;
        let cert_field = Field { config, name: "provider" };
        if let (Some(cert), Some(key)) = (cert, key) {
            let key = String::from_utf8(key)
                .map_err(|_| cert_field.invalid(&dir.path().join(DEV_KEY), "the dev CA's key is not text"))?;
            return Self::from_pem(
                &cert_field,
                &dir.path().join(DEV_CERT),
                &cert,
                &cert_field,
                &dir.path().join(DEV_KEY),
                &key,
            );
        }
        let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256).map_err(CaLoadError::DevMake)?;
        let mut params = CertificateParams::default();
        let mut name = DistinguishedName::new();
        name.push(DnType::CommonName, format!("tether dev CA {}", connect.trust_domain));
        params.distinguished_name = name;
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.key_usages =
            vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
        let uri = format!("spiffe://{}", connect.trust_domain);
        params.subject_alt_names = vec![SanType::URI(uri.try_into().map_err(CaLoadError::DevMake)?)];
        let now = SystemTime::now();
        params.not_before = (now - BACKDATE).into();
        params.not_after = (now + DEV_CA_LIFE).into();
        params.serial_number = Some(random_serial());
        let cert = params.self_signed(&key).map_err(CaLoadError::DevMake)?;
        dir.write_atomic(DEV_KEY, Durability::PowerLoss, key.serialize_pem().as_bytes()).map_err(store_error)?;
        dir.write_atomic(DEV_CERT, Durability::PowerLoss, cert.pem().as_bytes()).map_err(store_error)?;
        tracing::info!(dir = %DisplayPath(dir.path()), trust_domain = %connect.trust_domain, "made the dev CA");
        Self::from_pem(
            &cert_field,
            &dir.path().join(DEV_CERT),
            cert.pem().as_bytes(),
            &cert_field,
            &dir.path().join(DEV_KEY),
            &key.serialize_pem(),
        )
    }

    /// The roots: the CA's own first.
    pub(crate) fn root_list(&self) -> &[CaRoot] {
        &self.roots
    }
}

impl CertificateAuthority for Authority {
    fn roots(&self) -> Vec<CaRoot> {
        self.roots.clone()
    }

    fn issue(&self, request: LeafRequest) -> Result<IssuedLeaf, CaError> {
        let sign_error =
            |source: rcgen::Error| CaError::Sign { service: request.service_id.clone(), source: source.into() };
        let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256).map_err(sign_error)?;
        let mut params = CertificateParams::default();
        let mut name = DistinguishedName::new();
        name.push(DnType::CommonName, request.service_id.as_str());
        params.distinguished_name = name;
        params.subject_alt_names =
            vec![SanType::URI(request.spiffe_id.as_str().to_owned().try_into().map_err(sign_error)?)];
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature, KeyUsagePurpose::KeyAgreement];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
        params.use_authority_key_identifier_extension = true;
        let serial = random_serial();
        params.serial_number = Some(serial.clone());
        // Whole seconds: what the certificate can say.
        let now = whole_seconds(SystemTime::now());
        let not_before = now - BACKDATE;
        let not_after = now + request.ttl;
        params.not_before = not_before.into();
        params.not_after = not_after.into();
        let cert = params.signed_by(&key, &self.issuer).map_err(sign_error)?;
        Ok(IssuedLeaf {
            serial: serial_text(&serial.to_bytes()),
            cert_pem: cert.pem(),
            key: PrivateKeyPem::new(key.serialize_pem()),
            spiffe_id: request.spiffe_id,
            not_before,
            not_after,
        })
    }
}

/// Reads the CA's key file, which must be the agent user's own and closed to everyone else.
fn read_private_key(field: &Field<'_>, path: &Path) -> Result<String, CaLoadError> {
    let file = std::fs::File::open(path).map_err(|source| CaLoadError::Read {
        config: field.config.to_owned(),
        field: field.name,
        path: path.to_owned(),
        source,
    })?;
    let meta = file.metadata().map_err(|source| CaLoadError::Read {
        config: field.config.to_owned(),
        field: field.name,
        path: path.to_owned(),
        source,
    })?;
    let mode = meta.mode() & 0o7777;
    if mode & 0o077 != 0 {
        return Err(field.invalid(
            path,
            format!("its mode is {mode:04o}: a private key must be 0600, readable by the agent's user alone"),
        ));
    }
    let agent = nix::unistd::geteuid().as_raw();
    if meta.uid() != agent {
        return Err(field.invalid(
            path,
            format!("it is owned by uid {}: a private key must be owned by the agent's user (uid {agent})", meta.uid()),
        ));
    }
    let mut text = String::new();
    std::io::Read::read_to_string(&mut &file, &mut text)
        .map_err(|_| field.invalid(path, "not a PEM private key: it is not text"))?;
    Ok(text)
}

/// The PEM blocks of `text`, each a certificate.
fn read_pems(field: &Field<'_>, path: &Path, text: &[u8]) -> Result<Vec<Pem>, CaLoadError> {
    let mut pems = Vec::new();
    for pem in Pem::iter_from_buffer(text) {
        let pem = pem.map_err(|err| field.invalid(path, format!("malformed PEM: {err}")))?;
        if pem.label != "CERTIFICATE" {
            return Err(field.invalid(path, format!("holds a `{}` block where a CERTIFICATE was expected", pem.label)));
        }
        pems.push(pem);
    }
    if pems.is_empty() {
        return Err(field.invalid(path, "malformed PEM: no `BEGIN CERTIFICATE` block"));
    }
    Ok(pems)
}

/// The certificate of `pem`, which must be a CA valid now.
fn parse_ca<'a>(field: &Field<'_>, path: &Path, pem: &'a Pem) -> Result<X509Certificate<'a>, CaLoadError> {
    let cert = pem.parse_x509().map_err(|err| field.invalid(path, format!("not a valid X.509 certificate: {err}")))?;
    if !cert.is_ca() {
        return Err(field.invalid(path, "not a CA certificate (its basic constraints do not say CA:TRUE)"));
    }
    if !cert.validity().is_valid() {
        return Err(field.invalid(
            path,
            format!("not valid now: valid from {} to {}", cert.validity().not_before, cert.validity().not_after),
        ));
    }
    Ok(cert)
}

fn root_of(cert: &X509Certificate<'_>, pem: &Pem, active: bool) -> CaRoot {
    let encoded = ::pem::encode(&::pem::Pem::new("CERTIFICATE", pem.contents.clone()));
    CaRoot {
        serial: serial_text(cert.raw_serial()),
        cert_pem: encoded,
        not_after: system_time(cert.validity().not_after.timestamp()),
        active,
    }
}

/// A positive serial number of 128 random bits.
fn random_serial() -> SerialNumber {
    let mut bytes = [0u8; 16];
    // The OS CSPRNG does not fail on a kernel that runs tether; a failure leaves zeros,
    // which only makes serials collide, never a certificate invalid.
    let _ = getrandom::fill(&mut bytes);
    bytes[0] &= 0x7f;
    bytes[0] |= 0x01;
    SerialNumber::from_slice(&bytes)
}

/// A serial as lowercase hex pairs separated by `:`.
pub(crate) fn serial_text(bytes: &[u8]) -> String {
    bytes.iter().map(|byte| format!("{byte:02x}")).collect::<Vec<_>>().join(":")
}

fn whole_seconds(time: SystemTime) -> SystemTime {
    let since = time.duration_since(UNIX_EPOCH).unwrap_or_default();
    UNIX_EPOCH + Duration::from_secs(since.as_secs())
}

fn system_time(seconds: i64) -> SystemTime {
    match u64::try_from(seconds) {
        Ok(seconds) => UNIX_EPOCH + Duration::from_secs(seconds),
        Err(_) => UNIX_EPOCH,
    }
}

#[cfg(test)]
mod tests;
