//! The ADS service over gRPC, as the server that tonic generates for it, but with smaller
//! buffers per stream: each stream's encoder and decoder start at [`BUFFER`] bytes (and grow
//! for a larger message) rather than tonic's 8 KiB each, and the responses that wait for
//! Envoy are boxed, so that the channel's slots stay small. An agent holds one stream per
//! Envoy, all open at once and idle most of the time: what each holds while idle is what
//! counts.

use std::convert::Infallible;
use std::marker::PhantomData;
use std::pin::Pin;
use std::task::{Context, Poll};

use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
};
use tokio::sync::mpsc;
use tonic::codec::{BufferSettings, Codec};
use tonic::codegen::{Body, BoxFuture, Service, StdError, http};
use tonic::server::{Grpc, NamedService, StreamingService};
use tonic::{Request, Response, Status, Streaming};
use tonic_prost::{ProstCodec, ProstDecoder, ProstEncoder};

use super::stream::{DeltaState, StreamState};
use super::{QUEUED_RESPONSES, TOKEN_METADATA, Xds};

/// The first size of each stream's encoding and decoding buffer: a discovery request from
/// Envoy fits, and a larger message grows it.
const BUFFER: usize = 1024;

/// How many encoded bytes tonic sends before it yields to the runtime: its default.
const YIELD_THRESHOLD: usize = 32 * 1024;

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
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let xds = self.0.clone();
        match request.uri().path() {
            STATE_OF_THE_WORLD => Box::pin(async move {
                let mut grpc = Grpc::new(SmallBuffers::<DiscoveryResponse, DiscoveryRequest>::default());
                Ok(grpc.streaming(Sotw(xds), request).await)
            }),
            DELTA => Box::pin(async move {
                let mut grpc = Grpc::new(SmallBuffers::<DeltaDiscoveryResponse, DeltaDiscoveryRequest>::default());
                Ok(grpc.streaming(Delta(xds), request).await)
            }),
            _ => Box::pin(async move { Ok(Status::unimplemented("").into_http()) }),
        }
    }
}

/// Prost's codec with buffers of [`BUFFER`] bytes to begin with.
struct SmallBuffers<T, U>(PhantomData<(T, U)>);

impl<T, U> Default for SmallBuffers<T, U> {
    fn default() -> Self {
        Self(PhantomData)
    }
}

impl<T, U> Codec for SmallBuffers<T, U>
where
    T: prost::Message + Send + 'static,
    U: prost::Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ProstEncoder<T>;
    type Decoder = ProstDecoder<U>;

    fn encoder(&mut self) -> ProstEncoder<T> {
        ProstCodec::<T, U>::raw_encoder(BufferSettings::new(BUFFER, YIELD_THRESHOLD))
    }

    fn decoder(&mut self) -> ProstDecoder<U> {
        ProstCodec::<T, U>::raw_decoder(BufferSettings::new(BUFFER, YIELD_THRESHOLD))
    }
}

/// The token of a stream's request, from its metadata.
fn token<T>(request: &Request<T>) -> Option<String> {
    request.metadata().get(TOKEN_METADATA).and_then(|value| value.to_str().ok()).map(str::to_owned)
}

/// State-of-the-world streams.
struct Sotw(Xds);

impl StreamingService<DiscoveryRequest> for Sotw {
    type Response = DiscoveryResponse;
    type ResponseStream = Outgoing<DiscoveryResponse>;
    type Future = BoxFuture<Response<Self::ResponseStream>, Status>;

    fn call(&mut self, request: Request<Streaming<DiscoveryRequest>>) -> Self::Future {
        let token = token(&request);
        let (responses, outgoing) = mpsc::channel(QUEUED_RESPONSES);
        // The stream's task ends with the stream: when Envoy goes away (the channel closes),
        // when its requests end, or when the server stops.
        tokio::spawn(self.0.clone().stream::<StreamState>(token, request.into_inner(), responses));
        Box::pin(async move { Ok(Response::new(Outgoing(outgoing))) })
    }
}

/// Incremental streams.
struct Delta(Xds);

impl StreamingService<DeltaDiscoveryRequest> for Delta {
    type Response = DeltaDiscoveryResponse;
    type ResponseStream = Outgoing<DeltaDiscoveryResponse>;
    type Future = BoxFuture<Response<Self::ResponseStream>, Status>;

    fn call(&mut self, request: Request<Streaming<DeltaDiscoveryRequest>>) -> Self::Future {
        let token = token(&request);
        let (responses, outgoing) = mpsc::channel(QUEUED_RESPONSES);
        tokio::spawn(self.0.clone().stream::<DeltaState>(token, request.into_inner(), responses));
        Box::pin(async move { Ok(Response::new(Outgoing(outgoing))) })
    }
}

/// What a stream's task sends, boxed while it waits in the channel.
pub(super) type Queued<T> = Box<Result<T, Status>>;

/// The responses of one stream, as tonic sends them.
pub(super) struct Outgoing<T>(mpsc::Receiver<Queued<T>>);

impl<T> tokio_stream::Stream for Outgoing<T> {
    type Item = Result<T, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.0.poll_recv(cx).map(|next| next.map(|queued| *queued))
    }
}
