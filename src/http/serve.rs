//! The accept loop of the HTTP API: a bounded number of connections, a deadline for every request's headers, and a
//! graceful stop.
//!
//! States of a connection: `accepted` (a permit of `http.max_connections` taken; without one the connection is closed
//! at once, so a flood of connections cannot exhaust the daemon's memory or descriptors), `serving` (HTTP/1.1 with
//! keep-alive; the headers of each request must arrive within the header timeout, so a client that trickles them in
//! is cut off), `closing` (after the stop: requests in flight finish, idle connections close). Bodies have their own
//! deadline, `http.body_timeout`, applied where a body is read (`captures.rs`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};

/// What a connection may take.
pub(super) struct Limits {
    pub max_connections: usize,
    pub header_timeout: Duration,
}

/// Connections closed at once because every permit was taken (for the metrics).
pub(super) static CONNECTIONS_REFUSED: AtomicU64 = AtomicU64::new(0);

/// Serves `router` on `listener` until `stop_rx` turns true, then lets requests in flight finish.
pub(super) async fn serve(listener: TcpListener, router: Router, limits: Limits, mut stop_rx: watch::Receiver<bool>) {
    let permits = Arc::new(Semaphore::new(limits.max_connections));
    let graceful = GracefulShutdown::new();
    let mut accept_errors = crate::retry::OutageLog::new("http accept failed");
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = stop_rx.wait_for(|stop| *stop) => break,
        };
        let stream = match accepted {
            Ok((stream, _peer)) => {
                accept_errors.recovered();
                stream
            }
            Err(error) => {
                // Out of descriptors, typically: pause instead of spinning on the error.
                accept_errors.failed(&error);
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            CONNECTIONS_REFUSED.fetch_add(1, Ordering::Relaxed);
            drop(stream);
            continue;
        };
        let _ = stream.set_nodelay(true);
        let mut builder = hyper::server::conn::http1::Builder::new();
        builder.timer(TokioTimer::new()).header_read_timeout(limits.header_timeout).keep_alive(true);
        let connection = builder.serve_connection(TokioIo::new(stream), TowerToHyperService::new(router.clone()));
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            if let Err(error) = connection.await {
                tracing::debug!(%error, "http connection ended with an error");
            }
            drop(permit);
        });
    }
    drop(listener);
    graceful.shutdown().await;
}
