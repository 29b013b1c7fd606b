//! A fault-injecting TCP proxy between the code under test and a real service.
//!
//! Modes apply at once to every connection, open or new:
//! - `pass`: forward both ways.
//! - `cut`: close every open connection; accept new ones and close them at once.
//! - `blackhole`: accept, read and discard, never answer, never close (requests already forwarded still run).
//! - `delay(d)`: forward both ways, each chunk held back by `d`.
//! - `blackhole_replies`: forward client -> server, discard server -> client: the statement runs, its reply is lost.
//! - `blackhole_replies_matching(p)`: pass, except that once a request containing `p` goes through a connection, every
//!   reply on that connection is discarded: exactly one kind of statement runs and loses its reply.
//!
//! It runs on its own tokio runtime, so sync and async tests can use it alike.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Pass,
    Cut,
    Blackhole,
    Delay(Duration),
    BlackholeReplies,
}

pub struct FaultProxy {
    addr: SocketAddr,
    upstream: SocketAddr,
    mode_tx: Arc<watch::Sender<Mode>>,
    /// Request bytes that make a connection swallow its replies (see `blackhole_replies_matching`).
    reply_filter: ReplyFilter,
    /// Patterns whose request chunks are counted (see `count_requests_containing`).
    counters: Counters,
    runtime: Option<tokio::runtime::Runtime>,
}

type ReplyFilter = Arc<std::sync::Mutex<Option<Vec<u8>>>>;
type Counters = Arc<std::sync::Mutex<Vec<(Vec<u8>, Arc<std::sync::atomic::AtomicU64>)>>>;

impl FaultProxy {
    /// Listen on `127.0.0.1:0` and forward to `upstream`, starting in `pass` mode.
    pub fn start(upstream: SocketAddr) -> FaultProxy {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("fault-proxy")
            .enable_all()
            .build()
            .expect("proxy runtime");
        let std_listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind proxy");
        std_listener.set_nonblocking(true).unwrap();
        let addr = std_listener.local_addr().unwrap();
        let (mode_tx, _) = watch::channel(Mode::Pass);
        let mode_tx = Arc::new(mode_tx);
        let accept_mode_tx = Arc::clone(&mode_tx);
        let reply_filter: ReplyFilter = Arc::default();
        let accept_reply_filter = Arc::clone(&reply_filter);
        let counters: Counters = Arc::default();
        let accept_counters = Arc::clone(&counters);
        runtime.spawn(async move {
            let listener = TcpListener::from_std(std_listener).expect("proxy listener");
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    continue;
                };
                let mode_rx = accept_mode_tx.subscribe();
                let matcher = Matcher {
                    filter: Arc::clone(&accept_reply_filter),
                    swallow: Arc::default(),
                    counters: Arc::clone(&accept_counters),
                };
                tokio::spawn(serve_connection(client, upstream, mode_rx, matcher));
            }
        });
        FaultProxy { addr, upstream, mode_tx, reply_filter, counters, runtime: Some(runtime) }
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn upstream(&self) -> SocketAddr {
        self.upstream
    }

    pub fn mode(&self) -> Mode {
        *self.mode_tx.borrow()
    }

    pub fn set_mode(&self, mode: Mode) {
        self.mode_tx.send_replace(mode);
    }

    pub fn pass(&self) {
        *self.reply_filter.lock().unwrap() = None;
        self.set_mode(Mode::Pass);
    }

    /// Pass everything, except replies on any connection that has carried a request containing `pattern`.
    pub fn blackhole_replies_matching(&self, pattern: &str) {
        *self.reply_filter.lock().unwrap() = Some(pattern.as_bytes().to_vec());
        self.set_mode(Mode::Pass);
    }

    /// From now on, count the requests (chunks sent to the service) that contain `pattern`.
    pub fn count_requests_containing(&self, pattern: &str) -> Arc<std::sync::atomic::AtomicU64> {
        let counter = Arc::new(std::sync::atomic::AtomicU64::new(0));
        self.counters.lock().unwrap().push((pattern.as_bytes().to_vec(), Arc::clone(&counter)));
        counter
    }

    pub fn cut(&self) {
        self.set_mode(Mode::Cut);
    }

    pub fn blackhole(&self) {
        self.set_mode(Mode::Blackhole);
    }

    pub fn delay(&self, delay: Duration) {
        self.set_mode(Mode::Delay(delay));
    }

    pub fn blackhole_replies(&self) {
        self.set_mode(Mode::BlackholeReplies);
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        // Allowed inside an async test, unlike dropping the runtime.
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

async fn serve_connection(client: TcpStream, upstream: SocketAddr, mode_rx: watch::Receiver<Mode>, matcher: Matcher) {
    let _ = client.set_nodelay(true);
    let initial_mode = *mode_rx.borrow();
    let server_opt = match initial_mode {
        Mode::Cut => return,
        // A pure black hole never needs the service.
        Mode::Blackhole => None,
        _ => TcpStream::connect(upstream).await.ok(),
    };
    let Some(server) = server_opt else {
        if initial_mode == Mode::Blackhole {
            blackhole_until_cut(client, mode_rx).await;
        }
        return;
    };
    let _ = server.set_nodelay(true);
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    let requests = pump(client_read, server_write, mode_rx.clone(), Direction::Requests, matcher.clone());
    let replies = pump(server_read, client_write, mode_rx.clone(), Direction::Replies, matcher);
    let mut cut_rx = mode_rx;
    let cut = async move {
        let _ = cut_rx.wait_for(|mode| *mode == Mode::Cut).await;
    };
    // Both halves end (and both sockets close) when either side is done with the connection or on cut; a pump in a
    // black-hole mode never finishes by itself, which keeps the connection open.
    tokio::select! {
        _ = async { tokio::join!(requests, replies) } => {}
        _ = cut => {}
    }
}

async fn blackhole_until_cut(mut client: TcpStream, mut mode_rx: watch::Receiver<Mode>) {
    let mut buffer = vec![0u8; 64 * 1024];
    let read_and_discard = async {
        loop {
            match client.read(&mut buffer).await {
                Ok(0) | Err(_) => std::future::pending::<()>().await,
                Ok(_) => {}
            }
        }
    };
    tokio::select! {
        _ = read_and_discard => {}
        _ = mode_rx.wait_for(|mode| *mode == Mode::Cut) => {}
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Direction {
    Requests,
    Replies,
}

/// Per-connection state of `blackhole_replies_matching`, and the request counters.
#[derive(Clone)]
struct Matcher {
    filter: ReplyFilter,
    swallow: Arc<std::sync::atomic::AtomicBool>,
    counters: Counters,
}

impl Matcher {
    fn swallowing(&self) -> bool {
        self.swallow.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Look for the pattern in a request chunk (with the tail of the previous chunk, in case it was split).
    fn inspect(&self, carry: &mut Vec<u8>, chunk: &[u8]) {
        for (pattern, counter) in self.counters.lock().unwrap().iter() {
            if chunk.windows(pattern.len()).any(|window| window == pattern.as_slice()) {
                counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }
        }
        let Some(pattern) = self.filter.lock().unwrap().clone() else { return };
        carry.extend_from_slice(chunk);
        if carry.windows(pattern.len()).any(|window| window == pattern.as_slice()) {
            self.swallow.store(true, std::sync::atomic::Ordering::SeqCst);
        }
        let keep = carry.len().saturating_sub(pattern.len());
        carry.drain(..keep);
    }
}

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mode_rx: watch::Receiver<Mode>,
    direction: Direction,
    matcher: Matcher,
) {
    let mut buffer = vec![0u8; 64 * 1024];
    let mut carry = Vec::new();
    loop {
        let read = match from.read(&mut buffer).await {
            Ok(0) | Err(_) => {
                let swallowing = match *mode_rx.borrow() {
                    Mode::Blackhole => true,
                    Mode::BlackholeReplies => direction == Direction::Replies,
                    _ => direction == Direction::Replies && matcher.swallowing(),
                };
                if swallowing {
                    // Never pass on a close the peer should not see.
                    std::future::pending::<()>().await;
                }
                let _ = to.shutdown().await;
                return;
            }
            Ok(read) => read,
        };
        if direction == Direction::Requests {
            matcher.inspect(&mut carry, &buffer[..read]);
        } else if matcher.swallowing() {
            continue;
        }
        let mode = *mode_rx.borrow();
        match mode {
            Mode::Pass => {}
            Mode::Cut => return,
            Mode::Blackhole => continue,
            Mode::BlackholeReplies if direction == Direction::Replies => continue,
            Mode::BlackholeReplies => {}
            Mode::Delay(delay) => tokio::time::sleep(delay).await,
        }
        if to.write_all(&buffer[..read]).await.is_err() {
            return;
        }
    }
}
