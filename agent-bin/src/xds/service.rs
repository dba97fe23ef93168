//! The ADS service over gRPC, written for an agent that holds one stream per Envoy, all open at
//! once and idle most of the time: what each holds while idle is what counts.
//!
//! Requests are decoded from the request body as they come ([`Requests`]), into a buffer that
//! is released once it holds no part of a message, rather than tonic's buffer per stream that
//! keeps the size of the largest request ever read (Envoy's first, with its node and the names
//! of all its extensions, is tens of KiB). Responses are encoded by the stream's task, each into
//! a buffer of its exact size that is freed once sent, rather than into a buffer per stream that
//! keeps the size of the largest response ever sent; the body of the HTTP/2 response only passes
//! them on, then ends with the stream's gRPC status in the trailers.

use std::convert::Infallible;
use std::future::{Ready, ready};
use std::marker::PhantomData;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::{Buf, Bytes, BytesMut};
use http_body_util::BodyExt;
use hyper::body::Frame;
use tokio::sync::mpsc;
use tonic::Status;
use tonic::codegen::{Body, Service, StdError, http};
use tonic::server::NamedService;

use super::stream::{DeltaState, Protocol, StreamState};
use super::{QUEUED_RESPONSES, TOKEN_METADATA, Xds};

/// The largest request read, as tonic's default: a larger one ends the stream.
const MAX_REQUEST: usize = 4 * 1024 * 1024;

/// The length of a gRPC message's prefix: a compression flag and a big-endian length.
const PREFIX: usize = 5;

const STATE_OF_THE_WORLD: &str = "/envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources";
const DELTA: &str = "/envoy.service.discovery.v3.AggregatedDiscoveryService/DeltaAggregatedResources";

/// The ADS service of `Xds`, for tonic's router.
#[derive(Clone)]
pub(super) struct Ads(pub(super) Xds);

impl NamedService for Ads {
    const NAME: &'static str = "envoy.service.discovery.v3.AggregatedDiscoveryService";
}

impl<B> Service<http::Request<B>> for Ads
where
    B: Body + Send + 'static,
    B::Error: Into<StdError> + Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = Ready<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let response = match request.uri().path() {
            STATE_OF_THE_WORLD => open::<StreamState, B>(&self.0, request),
            DELTA => open::<DeltaState, B>(&self.0, request),
            _ => Status::unimplemented("").into_http(),
        };
        ready(Ok(response))
    }
}

/// Starts the task of one stream of protocol `P`, and answers with the body it sends into.
fn open<P, B>(xds: &Xds, request: http::Request<B>) -> http::Response<tonic::body::Body>
where
    P: Protocol,
    B: Body + Send + 'static,
    B::Error: Into<StdError> + Send + 'static,
{
    let token = request.headers().get(TOKEN_METADATA).and_then(|value| value.to_str().ok()).map(str::to_owned);
    let requests = Requests::new(request.into_body());
    let (sender, receiver) = mpsc::channel(QUEUED_RESPONSES);
    // The stream's task ends with the stream: when Envoy goes away (the body is dropped), when
    // its requests end, or when the server stops.
    tokio::spawn(xds.clone().stream::<P>(token, requests, Responses(sender)));
    let mut response = http::Response::new(tonic::body::Body::new(Outgoing { queue: receiver, ended: false }));
    response.headers_mut().insert(http::header::CONTENT_TYPE, http::HeaderValue::from_static("application/grpc"));
    response
}

/// The requests of one stream, decoded from its body as they come.
pub(super) struct Requests<T> {
    body: tonic::body::Body,
    /// Bytes read and not decoded yet: empty, with nothing allocated, between messages.
    buffer: BytesMut,
    _message: PhantomData<fn() -> T>,
}

impl<T: prost::Message + Default> Requests<T> {
    fn new<B>(body: B) -> Self
    where
        B: Body + Send + 'static,
        B::Error: Into<StdError> + Send + 'static,
    {
        let body = body.map_frame(|frame| frame.map_data(|mut data| data.copy_to_bytes(data.remaining())));
        Self { body: tonic::body::Body::new(body), buffer: BytesMut::new(), _message: PhantomData }
    }

    /// The next request; `None` when Envoy ended its side of the stream between two requests.
    pub(super) async fn message(&mut self) -> Result<Option<T>, Status> {
        loop {
            if let Some(message) = self.decode()? {
                return Ok(Some(message));
            }
            match std::future::poll_fn(|cx| Pin::new(&mut self.body).poll_frame(cx)).await {
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        self.buffer.extend_from_slice(&data);
                    }
                }
                Some(Err(status)) => return Err(status),
                None if self.buffer.is_empty() => return Ok(None),
                None => return Err(Status::internal("the stream ended inside a message")),
            }
        }
    }

    /// A whole message from the buffer, if it holds one.
    fn decode(&mut self) -> Result<Option<T>, Status> {
        let Some(prefix) = self.buffer.get(..PREFIX) else { return Ok(None) };
        if prefix[0] != 0 {
            return Err(Status::unimplemented("compressed requests are not accepted"));
        }
        let length = u32::from_be_bytes([prefix[1], prefix[2], prefix[3], prefix[4]]) as usize;
        if length > MAX_REQUEST {
            return Err(Status::out_of_range(format!(
                "a request of {length} bytes is larger than the limit of {MAX_REQUEST} bytes"
            )));
        }
        if self.buffer.len() < PREFIX + length {
            // The buffer grows with what arrives, not with what the prefix announces: a
            // client that announces 4 MiB and sends 5 bytes holds 5 bytes.
            return Ok(None);
        }
        self.buffer.advance(PREFIX);
        let message = T::decode(self.buffer.split_to(length)).map_err(|error| Status::internal(error.to_string()));
        if self.buffer.is_empty() {
            // Release what the message took, however large it was.
            self.buffer = BytesMut::new();
        }
        message.map(Some)
    }
}

/// What a stream's task sends its body: an encoded message, or the status that ends the stream.
/// Boxed while it waits in the channel, so that the channel's slots stay small.
enum Outbound {
    Message(Bytes),
    End(Status),
}

/// Where a stream's task sends its responses.
pub(super) struct Responses(mpsc::Sender<Box<Outbound>>);

/// The stream's body is gone (Envoy went away, or the server stopped), or the stream ended.
#[derive(Debug)]
pub(super) struct Gone;

impl Responses {
    /// Encodes `messages`, then sends them in order, waiting while [`QUEUED_RESPONSES`] wait
    /// for Envoy to take them. A message that cannot be encoded ends the stream.
    pub(super) async fn send_all<M: prost::Message>(&self, messages: Vec<M>) -> Result<(), Gone> {
        let encoded: Vec<Box<Outbound>> = messages
            .iter()
            .map(|message| {
                Box::new(match encode(message) {
                    Ok(bytes) => Outbound::Message(bytes),
                    Err(status) => Outbound::End(status),
                })
            })
            .collect();
        drop(messages);
        for outbound in encoded {
            let ends = matches!(*outbound, Outbound::End(_));
            self.0.send(outbound).await.map_err(|_| Gone)?;
            if ends {
                return Err(Gone);
            }
        }
        Ok(())
    }

    /// Ends the stream with `status`.
    pub(super) fn end(&self, status: Status) -> impl Future<Output = ()> + use<'_> {
        let outbound = Box::new(Outbound::End(status));
        async move {
            // If the body is gone, nobody is left to tell.
            let _ = self.0.send(outbound).await;
        }
    }

    /// Waits until the stream's body is gone.
    pub(super) async fn closed(&self) {
        self.0.closed().await;
    }
}

/// `message` as one uncompressed gRPC message, in a buffer of its exact size.
fn encode(message: &impl prost::Message) -> Result<Bytes, Status> {
    let length = message.encoded_len();
    let prefix = u32::try_from(length)
        .map_err(|_| Status::resource_exhausted(format!("a response of {length} bytes is too large for gRPC")))?;
    let mut buffer = Vec::with_capacity(PREFIX + length);
    buffer.push(0);
    buffer.extend_from_slice(&prefix.to_be_bytes());
    message
        .encode(&mut buffer)
        .map_err(|error| Status::internal(format!("a response could not be encoded: {error}")))?;
    Ok(Bytes::from(buffer))
}

/// The body of a stream's HTTP/2 response: the messages its task sends, then the trailers of
/// the status that ends it (OK when the task ends without one).
struct Outgoing {
    queue: mpsc::Receiver<Box<Outbound>>,
    ended: bool,
}

impl Body for Outgoing {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        if self.ended {
            return Poll::Ready(None);
        }
        let status = match ready!(self.queue.poll_recv(cx)).map(|outbound| *outbound) {
            Some(Outbound::Message(bytes)) => return Poll::Ready(Some(Ok(Frame::data(bytes)))),
            Some(Outbound::End(status)) => status,
            None => Status::ok(""),
        };
        self.ended = true;
        let mut trailers = http::HeaderMap::with_capacity(2);
        Poll::Ready(Some(status.add_header(&mut trailers).map(|()| Frame::trailers(trailers))))
    }

    fn is_end_stream(&self) -> bool {
        self.ended
    }
}

#[cfg(test)]
mod tests {
    use envoy_types::pb::envoy::config::core::v3::Node;
    use envoy_types::pb::envoy::service::discovery::v3::{DiscoveryRequest, DiscoveryResponse};
    use http_body_util::StreamBody;
    use prost::Message;

    use super::*;

    /// The requests of a body made of `chunks`, one DATA frame each.
    fn requests(chunks: Vec<Vec<u8>>) -> Requests<DiscoveryRequest> {
        let frames = chunks.into_iter().map(|chunk| Ok::<_, Infallible>(Frame::data(Bytes::from(chunk))));
        Requests::new(StreamBody::new(tokio_stream::iter(frames)))
    }

    fn framed(request: &DiscoveryRequest) -> Vec<u8> {
        encode(request).unwrap().to_vec()
    }

    fn request(node: &str) -> DiscoveryRequest {
        DiscoveryRequest {
            node: Some(Node { id: node.to_owned(), ..Default::default() }),
            type_url: "type.googleapis.com/envoy.config.cluster.v3.Cluster".to_owned(),
            ..Default::default()
        }
    }

    #[tokio::test]
    async fn requests_split_across_frames_or_sharing_one_are_each_read_whole() {
        let (first, second, third) = (request("a"), request("b"), request("c"));
        let mut joined = framed(&first);
        let (head, tail) = joined.split_at(3);
        let (head, tail) = (head.to_vec(), tail.to_vec());
        joined = tail;
        joined.extend(framed(&second));
        let last = framed(&third);
        let (last_head, last_tail) = last.split_at(7);
        let mut requests = requests(vec![head, joined, last_head.to_vec(), last_tail.to_vec()]);
        assert_eq!(requests.message().await.unwrap(), Some(first));
        assert_eq!(requests.message().await.unwrap(), Some(second));
        assert_eq!(requests.message().await.unwrap(), Some(third));
        assert_eq!(requests.message().await.unwrap(), None);
    }

    #[tokio::test]
    async fn the_buffer_is_released_between_requests_however_large_the_last_was() {
        let mut large = request("a");
        large.resource_names = (0..2_000).map(|index| format!("cluster-{index}")).collect();
        let mut requests = requests(vec![framed(&large)]);
        assert_eq!(requests.message().await.unwrap(), Some(large));
        assert_eq!(requests.buffer.capacity(), 0);
    }

    #[tokio::test]
    async fn a_request_that_announces_more_than_it_sends_holds_only_what_it_sent() {
        let announced = [0, 0, 0x40, 0, 0, 1, 2, 3].to_vec();
        let mut requests = requests(vec![announced]);
        let status = requests.message().await.unwrap_err();
        assert_eq!(status.code(), tonic::Code::Internal, "{status:?}");
        assert!(requests.buffer.capacity() < 1024, "{} bytes held", requests.buffer.capacity());
    }

    #[tokio::test]
    async fn a_compressed_an_oversized_or_a_cut_request_ends_the_stream_with_its_reason() {
        let mut compressed = framed(&request("a"));
        compressed[0] = 1;
        let status = requests(vec![compressed]).message().await.unwrap_err();
        assert_eq!(status.code(), tonic::Code::Unimplemented, "{status:?}");

        let oversized = [0, 0x7f, 0xff, 0xff, 0xff].to_vec();
        let status = requests(vec![oversized]).message().await.unwrap_err();
        assert_eq!(status.code(), tonic::Code::OutOfRange, "{status:?}");

        let mut cut = framed(&request("a"));
        cut.truncate(cut.len() - 1);
        let status = requests(vec![cut]).message().await.unwrap_err();
        assert_eq!(status.code(), tonic::Code::Internal, "{status:?}");

        let garbage = [0, 0, 0, 0, 3, 0xff, 0xff, 0xff].to_vec();
        let status = requests(vec![garbage]).message().await.unwrap_err();
        assert_eq!(status.code(), tonic::Code::Internal, "{status:?}");
    }

    #[test]
    fn a_message_is_encoded_with_its_grpc_prefix_in_a_buffer_of_its_size() {
        let response = DiscoveryResponse { version_info: "v1".to_owned(), nonce: "7".to_owned(), ..Default::default() };
        let bytes = encode(&response).unwrap();
        let body = response.encode_to_vec();
        assert_eq!(bytes[0], 0, "not compressed");
        assert_eq!(u32::from_be_bytes(bytes[1..5].try_into().unwrap()) as usize, body.len());
        assert_eq!(&bytes[PREFIX..], &body[..]);
        assert_eq!(DiscoveryResponse::decode(&bytes[PREFIX..]).unwrap(), response);
    }

    async fn next(body: &mut Outgoing) -> Option<Result<Frame<Bytes>, Status>> {
        std::future::poll_fn(|cx| Pin::new(&mut *body).poll_frame(cx)).await
    }

    #[tokio::test]
    async fn the_body_passes_messages_on_then_ends_with_the_status_in_trailers() {
        let (sender, queue) = mpsc::channel(QUEUED_RESPONSES);
        let responses = Responses(sender);
        let mut body = Outgoing { queue, ended: false };
        let response = DiscoveryResponse { version_info: "v1".to_owned(), ..Default::default() };
        responses.send_all(vec![response.clone()]).await.unwrap();
        responses.end(Status::permission_denied("not its token")).await;

        let data = next(&mut body).await.unwrap().unwrap().into_data().unwrap();
        assert_eq!(DiscoveryResponse::decode(&data[PREFIX..]).unwrap(), response);
        let trailers = next(&mut body).await.unwrap().unwrap().into_trailers().unwrap();
        assert_eq!(trailers["grpc-status"], "7");
        assert_eq!(trailers["grpc-message"], "not%20its%20token");
        assert!(body.is_end_stream());
        assert!(next(&mut body).await.is_none());
    }

    #[tokio::test]
    async fn a_stream_whose_task_ends_without_a_status_ends_ok() {
        let (sender, queue) = mpsc::channel(QUEUED_RESPONSES);
        let mut body = Outgoing { queue, ended: false };
        drop(Responses(sender));
        let trailers = next(&mut body).await.unwrap().unwrap();
        assert_eq!(trailers.into_trailers().unwrap()["grpc-status"], "0");
    }

    #[tokio::test]
    async fn sending_after_the_body_is_gone_says_so() {
        let (sender, queue) = mpsc::channel(QUEUED_RESPONSES);
        let responses = Responses(sender);
        drop(queue);
        assert!(responses.send_all(vec![DiscoveryResponse::default()]).await.is_err());
        tokio::time::timeout(std::time::Duration::from_secs(5), responses.closed()).await.unwrap();
    }
}
