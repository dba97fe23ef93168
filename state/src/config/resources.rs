//! The schema of `memory_max`, `cpus` and `pids_max`, as read.

use super::schema::deserialize_size;
use super::*;

/// `memory_max`: a size such as `"256MiB"`, or a number of bytes.
pub(super) struct MemoryMax(pub(super) u64);

impl MemoryMax {
    fn checked(bytes: u64) -> Result<Self, String> {
        if bytes < ResourceLimits::MIN_MEMORY {
            return Err(format!(
                "memory_max of {bytes} bytes is below the minimum of {} (1MiB)",
                ResourceLimits::MIN_MEMORY
            ));
        }
        Ok(Self(bytes))
    }
}

impl<'de> Deserialize<'de> for MemoryMax {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserialize_size(deserializer, MemoryMax::checked)
    }
}

/// `cpus`: a number of cores, such as `0.5` or `2`.
pub(super) struct Cpus(pub(super) CpuLimit);

impl<'de> Deserialize<'de> for Cpus {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct CpusVisitor;

        impl Visitor<'_> for CpusVisitor {
            type Value = Cpus;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a number of cores such as 0.5 or 2")
            }

            fn visit_f64<E: de::Error>(self, cores: f64) -> Result<Cpus, E> {
                CpuLimit::from_cores(cores).map(Cpus).map_err(E::custom)
            }

            fn visit_u64<E: de::Error>(self, cores: u64) -> Result<Cpus, E> {
                self.visit_f64(cores as f64)
            }

            fn visit_i64<E: de::Error>(self, cores: i64) -> Result<Cpus, E> {
                self.visit_f64(cores as f64)
            }
        }

        deserializer.deserialize_any(CpusVisitor)
    }
}

/// `pids_max`: at least 1.
pub(super) struct PidsMax(pub(super) u64);

impl<'de> Deserialize<'de> for PidsMax {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let pids = u64::deserialize(deserializer)?;
        if pids == 0 {
            return Err(de::Error::custom("pids_max must be at least 1: the proxy is one process"));
        }
        Ok(Self(pids))
    }
}
