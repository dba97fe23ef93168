//! The snapshot's bookkeeping: the writer task, started once restore is done, and the
//! record of each proxy sent to it whenever what runs changes.
//!
//! This module encodes records and hands them to the writer; it never writes a file itself
//! and never waits for a write, except through [`Manager::close`] and [`Manager::kill`]'s
//! flush.

use std::collections::BTreeMap;
use std::sync::Arc;

use tether_state::{ManagedProxy, ProxyId};
use tokio::sync::mpsc;
use tracing::Instrument;

use super::Manager;
use crate::snapshot::{EncodedRecord, EncodedService, WriterMessage, writer};

impl Manager {
    pub(super) fn start_writer(&mut self, saved: Option<BTreeMap<ProxyId, EncodedRecord>>) {
        let records: BTreeMap<ProxyId, EncodedRecord> =
            self.slots.keys().filter_map(|id| Some((id.clone(), self.record_of(id)?))).collect();
        let (sender, messages) = mpsc::unbounded_channel();
        let store = self.store.clone();
        let published = self.published.clone();
        self.background
            .spawn(writer(store, messages, records, saved, published).instrument(tracing::info_span!("snapshot")));
        self.writer = Some(sender);
    }

    pub(super) fn record_of(&self, id: &ProxyId) -> Option<EncodedRecord> {
        let installed = self.slots.get(id)?.installed.as_ref()?;
        let backend = installed.handle.record();
        match EncodedRecord::new(id, installed.service.as_ref(), installed.token.as_ref(), &backend) {
            Ok(record) => Some(record),
            Err(err) => {
                tracing::warn!(proxy = %id, error = %err, "cannot encode the snapshot record; it is left out");
                None
            }
        }
    }

    pub(super) fn send_record(&self, id: &ProxyId) {
        let Some(writer) = &self.writer else { return };
        let message = match self.record_of(id) {
            Some(record) => WriterMessage::Put(id.clone(), record),
            None => WriterMessage::Remove(id.clone()),
        };
        // A gone writer is reported by the next flush.
        let _ = writer.send(message);
    }
}

/// The service of `proxy`, as the snapshot records it: shared, encoded when written.
pub(super) fn encoded_service(proxy: &ManagedProxy) -> Option<EncodedService> {
    Some(EncodedService::new(Arc::clone(proxy.shared_service())))
}
