//! `gpucache-verbs-check`: is RDMA verbs usable here, and does a one-sided WRITE and READ
//! between two hosts move the right bytes?
//!
//! With no arguments it lists the RDMA devices. With `--listen PORT` on one host and
//! `--connect HOST:PORT` on the other, the listener exposes a 4 MiB region; the connecting side
//! WRITEs blocks of 64 KiB to 4 MiB into it, READs each back into a second buffer, compares the
//! bytes and times both; at the end the listener checks its region holds the last block written.
//! On a machine without RDMA it prints the typed reason and exits 2.
//!
//! Options: `--device NAME`, `--ib-port N` (1), `--gid-index N` (0), `--iterations N` (16),
//! `--deadline-ms N` (30000, control channel and each completion).
#![allow(clippy::print_stdout)] // a command-line report

use std::net::TcpListener;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use gpucache_nic::NicError;
use gpucache_nic::rdma::{self, VerbsConfig, VerbsEndpoint};
use gpucache_nic::verbs::{
    Access, CompletionStatus, LocalKey, NicEndpoint, Opcode, RemoteSlice, WorkCompletion,
    WorkRequest, WorkRequestId,
};

const BLOCK_BYTES: [usize; 4] = [64 << 10, 256 << 10, 1 << 20, 4 << 20];
const REGION_BYTES: usize = 4 << 20;

#[derive(Debug)]
enum Role {
    ListOnly,
    Listen(u16),
    Connect(String),
}

#[derive(Debug)]
struct Args {
    role: Role,
    config: VerbsConfig,
    iterations: u32,
    deadline: Duration,
}

fn parse() -> Result<Args, String> {
    let mut args = Args {
        role: Role::ListOnly,
        config: VerbsConfig::default(),
        iterations: 16,
        deadline: Duration::from_millis(30_000),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        let number = |v: String| v.parse::<u64>().map_err(|e| format!("{flag} {v}: {e}"));
        match flag.as_str() {
            "--listen" => {
                let v = value()?;
                args.role = Role::Listen(v.parse().map_err(|e| format!("--listen {v}: {e}"))?);
            }
            "--connect" => args.role = Role::Connect(value()?),
            "--device" => args.config.device = Some(value()?),
            "--ib-port" => {
                args.config.port = u8::try_from(number(value()?)?).map_err(|e| e.to_string())?
            }
            "--gid-index" => {
                args.config.gid_index =
                    u8::try_from(number(value()?)?).map_err(|e| e.to_string())?
            }
            "--iterations" => {
                args.iterations = u32::try_from(number(value()?)?).map_err(|e| e.to_string())?
            }
            "--deadline-ms" => args.deadline = Duration::from_millis(number(value()?)?),
            other => return Err(format!("unknown argument {other}")),
        }
    }
    if args.iterations == 0 {
        return Err("--iterations must be at least 1".into());
    }
    Ok(args)
}

fn main() -> ExitCode {
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("gpucache-verbs-check: {e}");
            return ExitCode::from(64);
        }
    };
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e @ NicError::VerbsUnavailable { .. }) => {
            eprintln!("gpucache-verbs-check: {e}");
            ExitCode::from(2)
        }
        Err(e) => {
            eprintln!("gpucache-verbs-check: failed: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &Args) -> Result<(), NicError> {
    let devices = rdma::discover()?;
    println!("{} RDMA device(s):", devices.len());
    for d in &devices {
        println!("  {}  guid {}  transport {}", d.name, d.guid, d.transport);
    }
    match &args.role {
        Role::ListOnly => Ok(()),
        Role::Listen(port) => listen(args, *port),
        Role::Connect(addr) => connect(args, addr),
    }
}

/// The byte at `i` of iteration `seed` of a `size`-byte block; both hosts compute it.
fn pattern(size: usize, seed: u32, i: usize) -> u8 {
    let mixed = i.wrapping_mul(31) ^ size.wrapping_add(seed as usize).wrapping_mul(7);
    mixed.to_le_bytes()[0]
}

fn control_failed(step: &'static str, e: std::io::Error) -> NicError {
    NicError::Connect { step, detail: e.to_string() }
}

fn listen(args: &Args, port: u16) -> Result<(), NicError> {
    let mut endpoint = args.config.open()?;
    let region = endpoint.register(REGION_BYTES as u64, Access::REMOTE_READ_WRITE)?;
    let listener = TcpListener::bind(("0.0.0.0", port))
        .map_err(|e| control_failed("binding the control port", e))?;
    println!("{}: listening on port {port}", endpoint.device());
    let mut control = rdma::control_accept(&listener, args.deadline)?;
    endpoint.connect(&mut control, Some(region.lkey))?;
    println!("connected; exposing {REGION_BYTES} bytes as rkey {:#x}", region.rkey.0);
    // The peer sends the last block's size and seed when it is done.
    let mut done = [0u8; 8];
    std::io::Read::read_exact(&mut control, &mut done)
        .map_err(|e| control_failed("waiting for the peer to finish", e))?;
    let size = u32::from_be_bytes([done[0], done[1], done[2], done[3]]) as usize;
    let seed = u32::from_be_bytes([done[4], done[5], done[6], done[7]]);
    let bytes = endpoint.region_bytes_mut(region.lkey).unwrap_or_default();
    let intact = size <= bytes.len()
        && bytes[..size].iter().enumerate().all(|(i, b)| *b == pattern(size, seed, i));
    std::io::Write::write_all(&mut control, &[u8::from(intact)])
        .map_err(|e| control_failed("reporting the check", e))?;
    println!("region holds the peer's last {size}-byte block: {intact}");
    if intact { Ok(()) } else { Err(mismatch("the listener's region")) }
}

fn mismatch(what: &str) -> NicError {
    NicError::VerbsCall { call: "verify", detail: format!("bytes differ in {what}") }
}

fn connect(args: &Args, addr: &str) -> Result<(), NicError> {
    // Two areas: the WRITE source and the READ destination, one registration. Declared before
    // the endpoint so that every exit, early ones included, deregisters before freeing it.
    let mut buffer = vec![0u8; 2 * REGION_BYTES];
    let mut endpoint = args.config.open()?;
    // SAFETY: `buffer` outlives `endpoint`'s use of it: the endpoint is dropped (deregistering)
    // at the end of this function before `buffer`, declared earlier, and every posted work
    // request is waited for before its area is touched again.
    let local =
        unsafe { endpoint.register_external(buffer.as_mut_ptr(), buffer.len(), Access::LOCAL)? };
    let mut control = rdma::control_connect(addr, args.deadline)?;
    let peer = endpoint.connect(&mut control, None)?.ok_or(NicError::Connect {
        step: "reading the peer's endpoint",
        detail: "the listener exposed no region".into(),
    })?;
    println!("connected to {addr}; peer region {} bytes", peer.len_bytes);
    println!("block_bytes  write_GB/s  read_GB/s  verified");
    let mut next_id = 0u64;
    let mut last = (0usize, 0u32);
    for size in BLOCK_BYTES {
        let (mut write_time, mut read_time) = (Duration::ZERO, Duration::ZERO);
        for seed in 0..args.iterations {
            let (source, dest) = buffer.split_at_mut(REGION_BYTES);
            for (i, b) in source[..size].iter_mut().enumerate() {
                *b = pattern(size, seed, i);
            }
            dest[..size].fill(0);
            let remote = RemoteSlice { rkey: peer.rkey, offset_bytes: 0, len_bytes: size as u64 };
            write_time += one(
                &mut endpoint,
                &mut next_id,
                local.lkey,
                Opcode::Write,
                remote,
                &mut source[..size],
                args.deadline,
            )?;
            read_time += one(
                &mut endpoint,
                &mut next_id,
                local.lkey,
                Opcode::Read,
                remote,
                &mut dest[..size],
                args.deadline,
            )?;
            if source[..size] != dest[..size] {
                return Err(mismatch("a block read back"));
            }
            last = (size, seed);
        }
        let moved = size as f64 * f64::from(args.iterations);
        println!(
            "{size:>11}  {:>10.2}  {:>9.2}  yes",
            moved / write_time.as_secs_f64() / 1e9,
            moved / read_time.as_secs_f64() / 1e9
        );
    }
    let mut done = [0u8; 8];
    done[..4].copy_from_slice(&u32::try_from(last.0).unwrap_or(0).to_be_bytes());
    done[4..].copy_from_slice(&last.1.to_be_bytes());
    std::io::Write::write_all(&mut control, &done)
        .map_err(|e| control_failed("telling the listener we are done", e))?;
    let mut verdict = [0u8; 1];
    std::io::Read::read_exact(&mut control, &mut verdict)
        .map_err(|e| control_failed("reading the listener's check", e))?;
    let remote_ok = verdict[0] == 1;
    println!(
        "summary: {} sizes x {} iterations written, read back and compared; listener region check: {}",
        BLOCK_BYTES.len(),
        args.iterations,
        if remote_ok { "ok" } else { "FAILED" }
    );
    drop(endpoint);
    drop(buffer);
    if remote_ok { Ok(()) } else { Err(mismatch("the listener's region")) }
}

/// Posts one work request and waits for its completion; returns how long that took.
fn one(
    endpoint: &mut VerbsEndpoint,
    next_id: &mut u64,
    lkey: LocalKey,
    opcode: Opcode,
    remote: RemoteSlice,
    local: &mut [u8],
    deadline: Duration,
) -> Result<Duration, NicError> {
    let id = WorkRequestId(*next_id);
    *next_id += 1;
    let start = Instant::now();
    endpoint.post(WorkRequest { id, opcode, lkey, remote }, local)?;
    let mut out: Vec<WorkCompletion> = Vec::with_capacity(1);
    while out.is_empty() {
        if start.elapsed() > deadline {
            return Err(NicError::VerbsCall {
                call: "ibv_poll_cq",
                detail: format!("no completion for {id} within {} ms", deadline.as_millis()),
            });
        }
        endpoint.poll(&mut out, 1);
    }
    let took = start.elapsed();
    match out[0].status {
        CompletionStatus::Success => Ok(took),
        status => Err(NicError::VerbsCall {
            call: "ibv_post_send",
            detail: format!("{id} completed with {status:?}"),
        }),
    }
}
