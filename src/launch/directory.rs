//! The job's key-value space (PMI-1 or the rendezvous service), served from a thread of its own.
//!
//! A rank talks to its launcher's key-value space at three moments: at start-up (publish its
//! endpoints, wait for everyone, read the job key), on first contact with a peer (read that
//! peer's endpoints: [`PeerDirectory::lookup`], called by the UDP carrier on the progress
//! path) and at [`finalize`](crate::launch::finalize). The connection lives on its own thread
//! with a single-threaded tokio runtime, so that
//!
//! * a lookup, which must block its caller (the carrier's `send` is synchronous, and a frame
//!   must not be lost for want of an address), never waits for the user's runtime, however
//!   busy or single-threaded it is;
//! * rank 0's rendezvous service, when it serves one, keeps answering while rank 0 computes.

use std::net::SocketAddr;
use std::sync::mpsc as std_mpsc;
use std::time::Duration;

use rankweave_core::TransportError;
use rankweave_transports::shm::{SegmentAddress, SegmentDirectory};
use rankweave_transports::udp::PeerDirectory;
use rankweave_transports::verbs::{UdDirectory, UdEndpoints};
use tokio::sync::{mpsc, oneshot};

use super::detect::{Bootstrap, RendezvousJob};
use super::kvs::{KvClient, KvError, KvServer};
use super::pmi::PmiClient;

/// How long a peer lookup may block before the send fails with `PeerUnreachable`.
const LOOKUP_PATIENCE: Duration = Duration::from_secs(10);
/// How long a rank waits for the rendezvous service to come up.
const CONNECT_PATIENCE: Duration = Duration::from_secs(30);
/// How long rank 0, serving the rendezvous, waits at finalize for the others to say goodbye.
const GOODBYE_PATIENCE: Duration = Duration::from_secs(10);
/// Key of a rank's published endpoints.
fn endpoint_key(rank: u32) -> String {
    format!("rw-ep-{rank}")
}
const JOB_KEY_KEY: &str = "rw-job-key";
/// Key of a rank's shared-memory segment address.
fn segment_key(rank: u32) -> String {
    format!("rw-shm-{rank}")
}

/// Key of a rank's UD endpoints (`RANKWEAVE_TRANSPORT=verbs`).
fn ud_key(rank: u32) -> String {
    format!("rw-ud-{rank}")
}

/// What the key-value space told a joining rank.
#[derive(Clone, Debug)]
pub(crate) struct Membership {
    pub rank: u32,
    pub size: u32,
    /// Every rank is on this host (loopback endpoints are reachable).
    pub all_local: bool,
    /// The launcher chose the job key.
    pub job_key: Option<u64>,
}

type Answer<T> = Box<dyn FnOnce(Result<T, String>) + Send>;

enum Request {
    Put(String, String, Answer<()>),
    Get(String, Answer<String>),
    Fence(Answer<()>),
    /// Last fence, goodbye, and (rank 0 serving the rendezvous) wait for the others' goodbyes.
    Finalize(Answer<()>),
}

/// A handle on the key-value thread; cheap to clone.
#[derive(Clone)]
pub(crate) struct JobDirectory {
    tx: mpsc::UnboundedSender<Request>,
    launcher: &'static str,
}

/// The launcher's key-value space, as the thread sees it.
enum Backend {
    Pmi(PmiClient),
    Kv {
        client: KvClient,
        /// Rank 0 serves the rendezvous itself.
        server: Option<KvServer>,
        size: u32,
    },
}

impl JobDirectory {
    /// Starts the thread, connects to the key-value space of `bootstrap` (not
    /// [`Bootstrap::Singleton`]) and reports who this rank is.
    pub(crate) async fn join(bootstrap: Bootstrap) -> Result<(JobDirectory, Membership), String> {
        let launcher = match &bootstrap {
            Bootstrap::Pmi(_) => "PMI-1",
            Bootstrap::Rendezvous(job) => job.launcher.name(),
            Bootstrap::Singleton => return Err("a singleton has no job to join".into()),
        };
        let (tx, rx) = mpsc::unbounded_channel();
        let (joined_tx, joined_rx) = oneshot::channel();
        std::thread::Builder::new()
            .name("rankweave-directory".into())
            .spawn(move || {
                let rt = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = joined_tx.send(Err(format!("cannot start a runtime: {e}")));
                        return;
                    }
                };
                rt.block_on(serve(bootstrap, joined_tx, rx));
            })
            .map_err(|e| format!("cannot start the directory thread: {e}"))?;
        let membership = joined_rx
            .await
            .map_err(|_| "the directory thread ended during start-up".to_string())??;
        Ok((JobDirectory { tx, launcher }, membership))
    }

    /// The launcher's name, for messages.
    pub(crate) fn launcher(&self) -> &'static str {
        self.launcher
    }

    async fn ask<T: Send + 'static>(
        &self,
        make: impl FnOnce(Answer<T>) -> Request,
    ) -> Result<T, String> {
        let (tx, rx) = oneshot::channel();
        self.tx
            .send(make(Box::new(move |r| {
                let _ = tx.send(r);
            })))
            .map_err(|_| "the directory thread has ended".to_string())?;
        rx.await
            .map_err(|_| "the directory thread has ended".to_string())?
    }

    pub(crate) async fn put(&self, key: String, value: String) -> Result<(), String> {
        self.ask(|a| Request::Put(key, value, a)).await
    }

    pub(crate) async fn get(&self, key: String) -> Result<String, String> {
        self.ask(|a| Request::Get(key, a)).await
    }

    pub(crate) async fn fence(&self) -> Result<(), String> {
        self.ask(Request::Fence).await
    }

    pub(crate) async fn finalize(&self) -> Result<(), String> {
        self.ask(Request::Finalize).await
    }

    /// Publishes this rank's route addresses.
    pub(crate) async fn publish(&self, rank: u32, addrs: &[SocketAddr]) -> Result<(), String> {
        self.put(endpoint_key(rank), encode_addrs(addrs)).await
    }

    /// Publishes this rank's shared-memory segment address.
    pub(crate) async fn publish_segment(
        &self,
        rank: u32,
        addr: &SegmentAddress,
    ) -> Result<(), String> {
        self.put(segment_key(rank), addr.encode()).await
    }

    /// Publishes this rank's UD endpoints (verbs).
    pub(crate) async fn publish_ud(
        &self,
        rank: u32,
        endpoints: &UdEndpoints,
    ) -> Result<(), String> {
        self.put(ud_key(rank), endpoints.encode()).await
    }

    /// Rank 0 publishes a fresh job key before the start-up fence; the others read it after.
    pub(crate) async fn publish_job_key(&self, key: u64) -> Result<(), String> {
        self.put(JOB_KEY_KEY.into(), format!("{key:016x}")).await
    }

    pub(crate) async fn job_key(&self) -> Result<u64, String> {
        let v = self.get(JOB_KEY_KEY.into()).await?;
        u64::from_str_radix(v.trim(), 16)
            .map_err(|_| format!("rank 0 published a bad job key {v:?}"))
    }
}

impl JobDirectory {
    /// Reads `key` from the thread that owns the key-value connection, blocking the caller
    /// (a transport on the progress path) for at most [`LOOKUP_PATIENCE`]. Failures name `rank`
    /// as unreachable.
    fn lookup_blocking(&self, rank: u32, key: String) -> Result<String, TransportError> {
        let (tx, rx) = std_mpsc::sync_channel(1);
        self.tx
            .send(Request::Get(
                key,
                Box::new(move |r| {
                    let _ = tx.send(r);
                }),
            ))
            .map_err(|_| unreachable(rank, "the directory thread has ended".into()))?;
        rx.recv_timeout(LOOKUP_PATIENCE)
            .map_err(|_| unreachable(rank, format!("no answer within {LOOKUP_PATIENCE:?}")))?
            .map_err(|e| unreachable(rank, e))
    }
}

fn unreachable(rank: u32, why: String) -> TransportError {
    tracing::warn!(rank, "looking the peer up failed: {why}");
    TransportError::PeerUnreachable(rank as usize)
}

impl PeerDirectory for JobDirectory {
    fn lookup(&self, rank: u32) -> Result<Vec<SocketAddr>, TransportError> {
        let value = self.lookup_blocking(rank, endpoint_key(rank))?;
        decode_addrs(&value)
            .ok_or_else(|| unreachable(rank, format!("bad endpoint record {value:?}")))
    }
}

impl SegmentDirectory for JobDirectory {
    fn lookup_segment(&self, rank: u32) -> Result<SegmentAddress, TransportError> {
        let value = self.lookup_blocking(rank, segment_key(rank))?;
        SegmentAddress::decode(&value)
            .ok_or_else(|| unreachable(rank, format!("bad segment record {value:?}")))
    }
}

impl UdDirectory for JobDirectory {
    fn lookup_ud(&self, rank: u32) -> Result<UdEndpoints, TransportError> {
        let value = self.lookup_blocking(rank, ud_key(rank))?;
        UdEndpoints::decode(&value).map_err(|e| unreachable(rank, e.to_string()))
    }
}

/// `ip:port,ip:port`: no spaces or `=`, so it is a valid PMI-1 value.
fn encode_addrs(addrs: &[SocketAddr]) -> String {
    addrs
        .iter()
        .map(SocketAddr::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

fn decode_addrs(v: &str) -> Option<Vec<SocketAddr>> {
    v.split(',')
        .map(|a| a.trim().parse().ok())
        .collect::<Option<Vec<_>>>()
        .filter(|a| !a.is_empty())
}

/// The thread's life: connect, report, then answer requests until finalize or until every
/// handle is gone.
async fn serve(
    bootstrap: Bootstrap,
    joined: oneshot::Sender<Result<Membership, String>>,
    mut rx: mpsc::UnboundedReceiver<Request>,
) {
    let (mut backend, membership) = match connect(bootstrap).await {
        Ok(x) => x,
        Err(e) => {
            let _ = joined.send(Err(e));
            return;
        }
    };
    let rank = membership.rank;
    if joined.send(Ok(membership)).is_err() {
        return;
    }
    while let Some(request) = rx.recv().await {
        match request {
            Request::Put(k, v, answer) => answer(backend.put(&k, &v).await),
            Request::Get(k, answer) => answer(backend.get(&k).await),
            Request::Fence(answer) => answer(backend.fence().await),
            Request::Finalize(answer) => {
                answer(backend.finalize(rank).await);
                return;
            }
        }
    }
}

async fn connect(bootstrap: Bootstrap) -> Result<(Backend, Membership), String> {
    match bootstrap {
        Bootstrap::Singleton => Err("a singleton has no job to join".into()),
        Bootstrap::Pmi(env) => {
            let mut client = PmiClient::from_pmi_env(env)
                .await
                .map_err(|e| e.to_string())?;
            client.init().await.map_err(|e| e.to_string())?;
            let (rank, size) = (client.rank() as u32, client.size() as u32);
            // Hydra describes the placement as `(vector,(first_node,nodes,ranks_per_node),...)`:
            // one block on one node means everyone is here.
            let all_local = match client.get("PMI_process_mapping").await {
                Ok(map) => single_node_mapping(&map),
                Err(_) => size == 1,
            };
            Ok((
                Backend::Pmi(client),
                Membership {
                    rank,
                    size,
                    all_local,
                    job_key: None,
                },
            ))
        }
        Bootstrap::Rendezvous(job) => connect_rendezvous(job).await,
    }
}

async fn connect_rendezvous(job: RendezvousJob) -> Result<(Backend, Membership), String> {
    let kv = |e: KvError| format!("rendezvous at {}: {e}", job.rendezvous);
    let mut server = None;
    if job.rank == 0 && job.rank0_serves {
        match KvServer::bind(job.rendezvous.as_str(), job.size as usize).await {
            Ok(s) => server = Some(s),
            // Someone else serves it (or will): use theirs.
            Err(KvError::Io { source, .. }) if source.kind() == std::io::ErrorKind::AddrInUse => {}
            Err(e) => return Err(kv(e)),
        }
    }
    let addr = match &server {
        Some(s) => s.local_addr().to_string(),
        None => job.rendezvous.clone(),
    };
    let client = KvClient::connect_retry(addr.as_str(), CONNECT_PATIENCE)
        .await
        .map_err(kv)?;
    if client.expected_ranks() != job.size as usize {
        return Err(format!(
            "the rendezvous service at {addr} expects {} ranks, but this job has {} (another job's service?)",
            client.expected_ranks(),
            job.size
        ));
    }
    Ok((
        Backend::Kv {
            client,
            server,
            size: job.size,
        },
        Membership {
            rank: job.rank,
            size: job.size,
            all_local: job.all_local,
            job_key: job.job_key,
        },
    ))
}

/// Whether a PMI-1 `PMI_process_mapping` value puts every rank on one node.
fn single_node_mapping(map: &str) -> bool {
    let inner = map.trim().trim_start_matches('(').trim_end_matches(')');
    let mut parts = inner.split(',').map(str::trim);
    if parts.next() != Some("vector") {
        return false;
    }
    let block: Vec<&str> = parts
        .map(|p| p.trim_matches(|c| c == '(' || c == ')'))
        .collect();
    match block.as_slice() {
        // The block repeats over the ranks: with one node in it, every rank lands on that node
        // whatever the ranks per node (Hydra says `(vector,(0,1,1))` for any -n on one host).
        [_, nodes, per_node] => nodes.parse::<u32>() == Ok(1) && per_node.parse::<u32>().is_ok(),
        _ => false,
    }
}

impl Backend {
    async fn put(&mut self, key: &str, value: &str) -> Result<(), String> {
        match self {
            Backend::Pmi(c) => c.put(key, value).await.map_err(|e| e.to_string()),
            Backend::Kv { client, .. } => client
                .put(key, value.as_bytes())
                .await
                .map_err(|e| e.to_string()),
        }
    }

    async fn get(&mut self, key: &str) -> Result<String, String> {
        match self {
            Backend::Pmi(c) => c.get(key).await.map_err(|e| e.to_string()),
            Backend::Kv { client, .. } => client
                .get(key)
                .await
                .map_err(|e| e.to_string())
                .and_then(|v| {
                    String::from_utf8(v).map_err(|_| format!("value of {key:?} is not text"))
                }),
        }
    }

    async fn fence(&mut self) -> Result<(), String> {
        match self {
            Backend::Pmi(c) => c.barrier().await.map_err(|e| e.to_string()),
            Backend::Kv { client, .. } => client.fence().await.map_err(|e| e.to_string()),
        }
    }

    async fn finalize(self, rank: u32) -> Result<(), String> {
        match self {
            Backend::Pmi(mut c) => {
                c.barrier().await.map_err(|e| e.to_string())?;
                c.finalize().await.map_err(|e| e.to_string())
            }
            Backend::Kv {
                mut client,
                server,
                size,
            } => {
                let fenced = client.fence().await.map_err(|e| e.to_string());
                let closed = client.close().await.map_err(|e| e.to_string());
                if let Some(mut server) = server {
                    let said = server
                        .wait_for_goodbyes(size as usize, GOODBYE_PATIENCE)
                        .await;
                    if said < size as usize {
                        tracing::warn!(
                            rank,
                            said,
                            size,
                            "not every rank said goodbye to the rendezvous"
                        );
                    }
                    server.shutdown().await;
                }
                fenced.and(closed)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoint_records_round_trip() {
        let addrs: Vec<SocketAddr> = vec![
            "127.0.0.1:5000".parse().unwrap(),
            "[::1]:6000".parse().unwrap(),
        ];
        let text = encode_addrs(&addrs);
        assert!(!text.contains(' ') && !text.contains('='));
        assert_eq!(decode_addrs(&text), Some(addrs));
        assert_eq!(decode_addrs(""), None);
        assert_eq!(decode_addrs("127.0.0.1:5000,nonsense"), None);
    }

    #[test]
    fn hydra_process_mappings() {
        assert!(single_node_mapping("(vector,(0,1,4))"));
        assert!(
            single_node_mapping("(vector,(0,1,1))"),
            "Hydra's form on one host"
        );
        assert!(!single_node_mapping("(vector,(0,2,2))"));
        assert!(!single_node_mapping("(vector,(0,1,2),(1,1,2))"));
        assert!(!single_node_mapping(""));
        assert!(!single_node_mapping("garbage"));
    }
}
