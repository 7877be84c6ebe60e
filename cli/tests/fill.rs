//! Single-flight fills across processes: 16 processes miss one key of a running `gpucache
//! serve` at once and ask to fill it (FILL_BEGIN). Exactly one leads; the 15 others join, are
//! charged nothing, and wait (FILL_WAIT) until the leader has stored the block and said so
//! (FILL_FINISH): each is then told `Finished` and reads the leader's bytes.
//!
//! The fillers are this test binary run again as children (`filler` below, which does nothing
//! unless GPUCACHE_FILL_ADDR is set); each waits for a line on its standard input before it
//! asks, so that all 16 ask together.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use gpucache_client::{ClientConfig, TcpStore};
use gpucache_dataplane::caller::{Caller, Rights};
use gpucache_dataplane::identity::KvDtype;
use gpucache_dataplane::shard::{FillNotice, FillOutcome, FillStart};
use gpucache_dataplane::store::{Get, Put, Store};
use gpucache_dataplane::testing::fixture::{key, payload, tenant};

mod common;

const FILLERS: usize = 16;
const BLOCK: usize = 64 << 10;
/// How long the test waits for any one line of a filler.
const LINE_PATIENCE: Duration = Duration::from_secs(60);

fn the_key() -> gpucache_dataplane::key::PhysicalKey {
    key(0, &[7, 7, 7], KvDtype::F16, 16)
}

/// One filler (a child process): ask, say what it got, then lead or wait.
#[test]
fn filler() {
    let Ok(addr) = std::env::var("GPUCACHE_FILL_ADDR") else { return };
    let caller = Caller::new(tenant(0), Rights::READ_WRITE);
    let store = TcpStore::new(ClientConfig::new(addr.parse().expect("addr"), caller.clone()));
    store.handshake(&caller).expect("session");
    let mut stdin = std::io::stdin().lock();
    let mut line = String::new();
    stdin.read_line(&mut line).expect("go");
    let k = the_key();
    let mut out = std::io::stdout().lock();
    match store.begin_fill(&caller, &k).expect("FILL_BEGIN") {
        Ok(FillStart::Lead(lease)) => {
            writeln!(out, "LEAD {}", lease.ticket.fill).expect("stdout");
            out.flush().expect("flush");
            line.clear();
            stdin.read_line(&mut line).expect("finish");
            let put = store.put(&caller, &k, &payload(9, BLOCK), None).expect("put");
            assert!(matches!(put, Put::Committed(_)), "{put:?}");
            let notice = store.finish_fill(&caller, &lease, FillOutcome::Stored).expect("finish");
            writeln!(out, "DONE {notice:?}").expect("stdout");
        }
        Ok(FillStart::Join(ticket)) => {
            writeln!(out, "JOIN {}", ticket.fill).expect("stdout");
            out.flush().expect("flush");
            let notice = store.wait_fill(&caller, &ticket, Duration::from_secs(25)).expect("wait");
            let mut buf = vec![0u8; BLOCK];
            let got = store.get_into(&caller, &k, &mut buf).expect("get");
            let same = matches!(got, Get::Hit { len, .. } if len == BLOCK as u64)
                && buf == payload(9, BLOCK);
            writeln!(out, "NOTICE {notice:?} {}", if same { "bytes-ok" } else { "bytes-wrong" })
                .expect("stdout");
        }
        Err(refused) => writeln!(out, "REFUSED {refused}").expect("stdout"),
    }
    out.flush().expect("flush");
}

struct Filler {
    child: Child,
    lines: mpsc::Receiver<String>,
}

impl Filler {
    fn start(addr: &str) -> Self {
        let mut child = Command::new(std::env::current_exe().expect("test binary"))
            .args(["--exact", "filler", "--nocapture", "--test-threads", "1"])
            .env("GPUCACHE_FILL_ADDR", addr)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn a filler");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                // The test harness prints its own words, on the same line as the first of the
                // filler's; each of the filler's starts with one of these.
                let start = ["LEAD ", "JOIN ", "NOTICE ", "DONE ", "REFUSED "]
                    .iter()
                    .filter_map(|w| line.find(w))
                    .min();
                if let Some(start) = start {
                    let _ = tx.send(line[start..].to_owned());
                }
            }
        });
        Self { child, lines }
    }

    fn say(&mut self, what: &str) {
        let stdin = self.child.stdin.as_mut().expect("stdin");
        writeln!(stdin, "{what}").expect("tell a filler");
        stdin.flush().expect("flush");
    }

    fn line(&self) -> String {
        self.lines.recv_timeout(LINE_PATIENCE).expect("a filler's line")
    }
}

#[test]
fn sixteen_fillers_of_one_key_in_sixteen_processes_make_one_leader_and_fifteen_finished_joiners() {
    if std::env::var_os("GPUCACHE_FILL_ADDR").is_some() {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let config = dir.path().join("gpucache.toml");
    std::fs::write(
        &config,
        format!(
            "[store]\nkind = \"memory\"\n\n\
             [listen]\nnative = \"127.0.0.1:0\"\nresp = \"127.0.0.1:0\"\nmetrics = \"127.0.0.1:0\"\n\n\
             [[tenants]]\nname = \"{}\"\nrights = [\"read\", \"write\"]\n",
            tenant(0)
        ),
    )
    .expect("config");
    let serve = common::Serve::start_in(dir.path(), &config);
    let addr = serve.native().to_string();
    let mut fillers: Vec<Filler> = (0..FILLERS).map(|_| Filler::start(&addr)).collect();
    for f in &mut fillers {
        f.say("go");
    }
    let first: Vec<String> = fillers.iter().map(Filler::line).collect();
    let leaders: Vec<usize> = (0..FILLERS).filter(|&i| first[i].starts_with("LEAD ")).collect();
    assert_eq!(leaders.len(), 1, "one leader: {first:?}");
    let fill = first[leaders[0]].split_whitespace().nth(1).expect("fill id").to_owned();
    let joiners = first.iter().filter(|l| **l == format!("JOIN {fill}")).count();
    assert_eq!(joiners, FILLERS - 1, "every other filler joined the same fill: {first:?}");

    // The joiners are waiting now; the leader stores the block and finishes.
    fillers[leaders[0]].say("finish");
    for (i, f) in fillers.iter().enumerate() {
        let last = f.line();
        if i == leaders[0] {
            assert_eq!(last, "DONE Finished");
        } else {
            assert_eq!(last, "NOTICE Finished bytes-ok", "joiner {i}");
        }
    }
    for mut f in fillers {
        let status = f.child.wait().expect("filler exits");
        assert!(status.success(), "a filler failed: {status}");
    }
    eprintln!("{FILLERS} fillers: 1 leader, {joiners} joiners told Finished, each read the block");

    // The fill is over: the next filler of the key leads a new one (nothing is left in flight).
    let caller = Caller::new(tenant(0), Rights::READ_WRITE);
    let store = TcpStore::new(ClientConfig::new(serve.native(), caller.clone()));
    match store.begin_fill(&caller, &the_key()).expect("FILL_BEGIN") {
        Ok(FillStart::Lead(lease)) => {
            assert_ne!(lease.ticket.fill.to_string(), fill, "a new fill");
            let notice = store.finish_fill(&caller, &lease, FillOutcome::GaveUp).expect("finish");
            assert_eq!(notice, FillNotice::Failed, "a leader that gives up fails its fill");
        }
        other => panic!("expected to lead a new fill: {other:?}"),
    }
    serve.stop();
}
