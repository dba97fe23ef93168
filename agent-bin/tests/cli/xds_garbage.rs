//! The xDS server against clients that are not Envoy: a hand-made gRPC client sends frames
//! that are no discovery request, requests of types nobody serves, no token, or never
//! acknowledges what it is sent. Each such stream ends (with an error where the client is
//! still there to read it), the agent stays up, and its memory does not grow with their
//! number.

use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::envoy::service::discovery::v3::DiscoveryRequest;
use prost::Message;
use prost::bytes::{Buf, BufMut};
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::transport::Channel;
use tonic::{Code, Status};

use crate::support::{Agent, Dirs, SweepOnDrop, sleeper, wait_for};
use crate::xds::{free_port, metric, printed_bootstrap, root_flags};

/// gRPC messages as raw bytes: what is sent is not checked to be a message of any type.
#[derive(Clone, Copy, Default)]
struct Raw;

impl Codec for Raw {
    type Encode = Vec<u8>;
    type Decode = Vec<u8>;
    type Encoder = Raw;
    type Decoder = Raw;

    fn encoder(&mut self) -> Raw {
        Raw
    }

    fn decoder(&mut self) -> Raw {
        Raw
    }
}

impl Encoder for Raw {
    type Item = Vec<u8>;
    type Error = Status;

    fn encode(&mut self, item: Vec<u8>, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        dst.put_slice(&item);
        Ok(())
    }
}

impl Decoder for Raw {
    type Item = Vec<u8>;
    type Error = Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Vec<u8>>, Status> {
        let bytes = src.copy_to_bytes(src.remaining());
        Ok(Some(bytes.to_vec()))
    }
}

const ADS: &str = "/envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources";

/// A discovery request of `type_url` from `web-proxy`, answering `nonce` if not empty.
fn request(type_url: &str, nonce: &str) -> Vec<u8> {
    DiscoveryRequest {
        node: Some(Node { id: "web-proxy".to_owned(), ..Node::default() }),
        type_url: type_url.to_owned(),
        response_nonce: nonce.to_owned(),
        ..DiscoveryRequest::default()
    }
    .encode_to_vec()
}

/// One ADS stream that sends `messages`, with `token` if given, and holds its side open until
/// it has read `read` responses or the stream ended; how the stream ended, or `None` when it
/// was still open after reading them.
async fn stream(channel: &Channel, token: Option<&str>, messages: Vec<Vec<u8>>, read: usize) -> Option<Status> {
    let mut grpc = tonic::client::Grpc::new(channel.clone());
    grpc.ready().await.unwrap();
    let (sender, receiver) = tokio::sync::mpsc::channel(messages.len().max(1));
    for message in messages {
        sender.send(message).await.unwrap();
    }
    let mut request = tonic::Request::new(tokio_stream::wrappers::ReceiverStream::new(receiver));
    if let Some(token) = token {
        request.metadata_mut().insert("x-tether-token", token.parse().unwrap());
    }
    let path = tonic::codegen::http::uri::PathAndQuery::from_static(ADS);
    let mut responses = match grpc.streaming(request, path, Raw).await {
        Ok(response) => response.into_inner(),
        Err(status) => return Some(status),
    };
    for _ in 0..read {
        match responses.message().await {
            Ok(Some(_)) => {}
            Ok(None) => return Some(Status::ok("ended")),
            Err(status) => return Some(status),
        }
    }
    if read > 0 {
        // Never answered: the stream is dropped with its responses unacknowledged.
        return None;
    }
    match responses.message().await {
        Ok(Some(_)) => None,
        Ok(None) => Some(Status::ok("ended")),
        Err(status) => Some(status),
    }
}

/// The agent's resident memory, in KiB, from `/proc`.
fn rss_kib(pid: i32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|line| line.starts_with("VmRSS:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// How many streams of each kind one round opens.
const PER_KIND: usize = 50;

/// One round of garbage, [`PER_KIND`] streams of each kind, each checked to end as it should.
async fn garbage_round(channel: &Channel, token: &str) {
    let cluster = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
    for _ in 0..PER_KIND {
        // Not a discovery request at all.
        let ended = stream(channel, Some(token), vec![vec![0xff; 64]], 0).await;
        let ended = ended.expect("a stream of garbage ended");
        assert_eq!(ended.code(), Code::InvalidArgument, "{ended:?}");
        // A request of a type nobody serves, then garbage.
        let ended = stream(channel, Some(token), vec![request("type.example/Nothing", ""), vec![0x08; 3]], 0).await;
        let ended = ended.expect("garbage after a request of an unknown type ended the stream");
        assert_eq!(ended.code(), Code::InvalidArgument, "{ended:?}");
        // No token.
        let ended = stream(channel, None, vec![request(cluster, "")], 0).await.expect("a stream without a token ended");
        assert_eq!(ended.code(), Code::PermissionDenied, "{ended:?}");
        // A real request, whose response is read and never acknowledged.
        let open = stream(channel, Some(token), vec![request(cluster, "")], 1).await;
        assert!(open.is_none(), "the stream that never acknowledges was served: {open:?}");
    }
}

#[test]
fn clients_that_send_garbage_or_never_acknowledge_cost_the_agent_nothing_that_stays() {
    let dirs = Dirs::new();
    let _sweep = SweepOnDrop(dirs.socket());
    let xds_port = free_port();
    dirs.write_config(
        "web.toml",
        &format!(
            "[[service]]\nname = \"web\"\nport = {}\n[service.proxy]\ncommand = [\"/bin/sleep\", \"3600\"]\n\
             config = {{ bind_port = {} }}\n",
            free_port(),
            free_port()
        ),
    );
    dirs.write_config("other.toml", &sleeper("other"));
    let xds_address = format!("127.0.0.1:{xds_port}");
    let mut flags = root_flags();
    flags.extend(["--xds-address", xds_address.as_str()]);
    let agent = Agent::start(&dirs, &flags);
    agent.wait_state("web-proxy", "running");
    let bootstrap = printed_bootstrap(&dirs, "web", free_port());
    let metadata = &bootstrap["dynamic_resources"]["ads_config"]["grpc_services"][0]["initial_metadata"][0];
    let token = metadata["value"].as_str().unwrap().to_owned();
    let pid = agent.pid().as_raw();

    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let (before, after, rounds) = runtime.block_on(async {
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{xds_address}"))
            .unwrap()
            .connect_timeout(Duration::from_secs(10))
            .connect()
            .await
            .unwrap();
        // The first rounds warm the allocator up; the rest must not grow it much.
        garbage_round(&channel, &token).await;
        let before = rss_kib(pid);
        let mut rounds = 1;
        while rounds * 4 * PER_KIND < 1000 {
            garbage_round(&channel, &token).await;
            rounds += 1;
        }
        (before, rss_kib(pid), rounds)
    });
    drop(runtime);
    let streams = rounds * 4 * PER_KIND;
    assert!(streams >= 1000, "{streams} streams");
    wait_for("every stream to be closed", || (metric(&agent, "tether_xds_streams", &[]) == 0.0).then_some(()));
    assert!(
        metric(&agent, "tether_xds_refused_streams_total", &[]) >= (rounds * PER_KIND) as f64,
        "every stream without a token counted"
    );
    let grown = after.saturating_sub(before);
    eprintln!("agent RSS {before} KiB after the first {} streams, {after} KiB after {streams}", 4 * PER_KIND);
    assert!(grown < 16 * 1024, "the agent grew by {grown} KiB over {streams} garbage streams");
    // The agent still serves: its API and a proper stream.
    assert_eq!(agent.proxy("web-proxy").unwrap()["state"], "running");
    assert!(agent.pid().as_raw() == pid);
}
