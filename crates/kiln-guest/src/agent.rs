//! The agent: PID 1 inside a box. One thread reads the host's requests; each process's
//! output, each port connection and each file operation gets its own thread, so a slow
//! reader, a full pipe or a planted fifo never stalls the channel; one thread waits for
//! signals, reaps every child (also orphans re-parented to PID 1) and forwards termination
//! signals to the processes it started.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::files;
use crate::proto::{
    self, Failure, FrameError, Op, PROTOCOL_VERSION, Reply, Request, Response, Spawn, WindowSize,
};

/// How long output is still read after a process exits, for what a background child that
/// kept the pipe open writes; then the process is reported exited.
const DRAIN_AFTER_EXIT: Duration = Duration::from_millis(100);

type Out = Arc<Mutex<Box<dyn Write + Send>>>;

/// Sends one response; a failed write means the host is gone, which the reader notices.
pub(crate) fn send(out: &Out, id: u64, reply: Reply) {
    let Ok(frame) = proto::encode(&Response { id, reply }) else {
        return;
    };
    let mut out = out.lock().unwrap_or_else(|e| e.into_inner());
    let _ = out.write_all(&frame).and_then(|()| out.flush());
}

/// A process the agent started.
struct Proc {
    pid: i32,
    /// Where [`Op::Stdin`] bytes go (a pipe or the terminal), through a writer thread.
    stdin: Option<mpsc::Sender<Vec<u8>>>,
    /// The terminal's master side, for [`Op::Resize`].
    terminal: Option<Arc<OwnedFd>>,
    /// Output streams still open.
    open_streams: u8,
    status: Option<(Option<i32>, Option<i32>)>,
    exited_at: Option<Instant>,
}

#[derive(Default)]
struct Table {
    procs: HashMap<u64, Proc>,
    by_pid: HashMap<i32, u64>,
    /// Open port connections' write sides, by request id.
    conns: HashMap<u64, mpsc::Sender<Vec<u8>>>,
}

struct Agent {
    out: Out,
    table: Mutex<Table>,
}

impl Agent {
    fn table(&self) -> std::sync::MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Reports `id` exited once its status is known and its output drained.
    fn maybe_finish(&self, id: u64) {
        let mut table = self.table();
        let Some(proc) = table.procs.get(&id) else {
            return;
        };
        let (Some((code, signal)), 0) = (proc.status, proc.open_streams) else {
            return;
        };
        let pid = proc.pid;
        table.procs.remove(&id);
        table.by_pid.remove(&pid);
        drop(table);
        send(&self.out, id, Reply::Exited { code, signal });
    }

    /// Whether `id`'s process exited long enough ago that its output is no longer waited for.
    fn drained(&self, id: u64) -> bool {
        self.table()
            .procs
            .get(&id)
            .and_then(|p| p.exited_at)
            .is_some_and(|at| at.elapsed() >= DRAIN_AFTER_EXIT)
    }

    fn stream_closed(&self, id: u64) {
        if let Some(proc) = self.table().procs.get_mut(&id) {
            proc.open_streams = proc.open_streams.saturating_sub(1);
        }
        self.maybe_finish(id);
    }

    /// Reaps every child that has exited.
    fn reap(&self) {
        loop {
            let mut status = 0;
            // The table is held while reaping so a spawn in progress (which holds it, and
            // whose failure path waits for its own child) never loses its child to us.
            let mut table = self.table();
            // SAFETY: waitpid(2) writes only to `status`, a live local c_int; -1 with WNOHANG reaps
            // any exited child without blocking.
            let pid = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) };
            if pid <= 0 {
                return;
            }
            let Some(id) = table.by_pid.get(&pid).copied() else {
                continue; // an orphan re-parented to us
            };
            let outcome = if libc::WIFSIGNALED(status) {
                (None, Some(libc::WTERMSIG(status)))
            } else {
                (Some(libc::WEXITSTATUS(status)), None)
            };
            if let Some(proc) = table.procs.get_mut(&id) {
                proc.status = Some(outcome);
                proc.exited_at = Some(Instant::now());
            }
            drop(table);
            self.maybe_finish(id);
        }
    }

    fn forward(&self, signal: i32) {
        for proc in self.table().procs.values() {
            // SAFETY: kill(2) takes only integers and touches no memory of ours; `-proc.pid` names
            // the process group of a child the agent started in a session of its own (setsid in
            // `command`), and a group that is already gone only makes the call fail (ignored).
            unsafe { libc::kill(-proc.pid, signal) };
        }
    }
}

/// Starts a thread; in a box whose pids limit is reached this fails, and the caller answers
/// the request with a failure instead of the agent dying.
fn thread(f: impl FnOnce() + Send + 'static) -> Result<(), Failure> {
    std::thread::Builder::new()
        .stack_size(256 << 10)
        .spawn(f)
        .map(drop)
        .map_err(|e| {
            Failure::new(
                "no_resources",
                format!("the box has no room for another thread (its pids limit?): {e}"),
            )
        })
}

/// The signals the agent waits for on its signal thread (blocked everywhere else).
fn watched_signals() -> libc::sigset_t {
    // SAFETY: sigset_t is plain data, so all-zero bytes are a valid value (sigemptyset then
    // initialises it as POSIX asks); sigemptyset and sigaddset only write to `set`, a live local,
    // and the signal numbers are valid.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for signal in [libc::SIGCHLD, libc::SIGTERM, libc::SIGINT, libc::SIGHUP] {
            libc::sigaddset(&mut set, signal);
        }
        set
    }
}

/// Serves the host on `input`/`output` until the host closes the channel; then every
/// process the agent started is killed.
pub fn serve(
    input: impl Read + 'static,
    output: impl Write + Send + 'static,
) -> Result<(), FrameError> {
    let channel: Channel = (Box::new(input), Box::new(output));
    serve_each(std::iter::once(channel))
}

/// One channel to the host: what it sends, and where replies go.
pub type Channel = (Box<dyn Read>, Box<dyn Write + Send>);

/// Serves the host on each channel in turn (a VM's vsock connections: a snapshot's clone
/// gets a new one), each until the host closes it; then every process the agent started
/// on it is killed, and the next one is served. The result is the last channel's.
pub fn serve_each(channels: impl IntoIterator<Item = Channel>) -> Result<(), FrameError> {
    let set = watched_signals();
    // SAFETY: `set` is an initialised sigset_t (from `watched_signals`) alive for the call, which
    // only reads it; the old mask is not wanted, and a null `oldset` is allowed.
    unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
    let agent = Arc::new(Agent {
        out: Arc::new(Mutex::new(Box::new(std::io::sink()))),
        table: Mutex::new(Table::default()),
    });
    {
        let agent = agent.clone();
        std::thread::spawn(move || {
            loop {
                let mut signal = 0;
                // SAFETY: `set` (an initialised sigset_t moved into this thread) and `signal` (a
                // live local c_int) are valid for the call, which reads the one and writes the
                // other.
                if unsafe { libc::sigwait(&set, &mut signal) } != 0 {
                    continue;
                }
                match signal {
                    libc::SIGCHLD => agent.reap(),
                    other => agent.forward(other),
                }
            }
        });
    }
    let mut result = Ok(());
    for (mut input, output) in channels {
        *agent
            .out
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = output;
        result = loop {
            match proto::read_frame::<_, Request>(&mut input) {
                Ok(request) => handle(&agent, request),
                Err(FrameError::Malformed(e)) => {
                    // The frame was read whole: answer it and go on.
                    send(
                        &agent.out,
                        0,
                        Reply::Failed(Failure::new("invalid", format!("malformed request: {e}"))),
                    );
                }
                Err(FrameError::Closed) => break Ok(()),
                Err(e) => break Err(e),
            }
        };
        agent.forward(libc::SIGKILL);
    }
    result
}

fn handle(agent: &Arc<Agent>, Request { id, op }: Request) {
    match op {
        Op::Hello => send(
            &agent.out,
            id,
            Reply::Hello {
                version: PROTOCOL_VERSION,
                pid: std::process::id(),
            },
        ),
        Op::Spawn(spec) => {
            if let Err(failure) = spawn(agent, id, spec) {
                send(&agent.out, id, Reply::Failed(failure));
            }
        }
        Op::Stdin { target, data, eof } => {
            let mut table = agent.table();
            let sender = match table.procs.get_mut(&target) {
                Some(proc) if eof => proc.stdin.take(),
                Some(proc) => proc.stdin.clone(),
                None if eof => table.conns.remove(&target),
                None => table.conns.get(&target).cloned(),
            };
            drop(table);
            if let Some(sender) = sender
                && !data.is_empty()
            {
                let _ = sender.send(data);
            }
        }
        Op::Signal { target, signal } => {
            if let Some(proc) = agent.table().procs.get(&target) {
                // SAFETY: kill(2) takes only integers and touches no memory of ours: the host's
                // signal number is checked by the kernel (a bad one is EINVAL, ignored), and
                // `-proc.pid` names the process group of a child the agent started in a session of
                // its own (setsid in `command`).
                unsafe { libc::kill(-proc.pid, signal) };
            }
        }
        Op::Resize { target, size } => {
            if let Some(fd) = agent
                .table()
                .procs
                .get(&target)
                .and_then(|p| p.terminal.clone())
            {
                set_window_size(fd.as_raw_fd(), size);
            }
        }
        Op::Connect { port } => connect(agent, id, port),
        Op::Listen { port } => listen(agent, id, port),
        Op::Thaw { seed, now_ms } => send(
            &agent.out,
            id,
            match thaw(&seed, now_ms) {
                Ok(()) => Reply::Done,
                Err(failure) => Reply::Failed(failure),
            },
        ),
        file_op => {
            let out = agent.out.clone();
            if let Err(failure) = thread(move || files::serve(&out, id, file_op)) {
                send(&agent.out, id, Reply::Failed(failure));
            }
        }
    }
}

fn set_window_size(fd: i32, size: WindowSize) {
    let ws = libc::winsize {
        ws_row: size.rows,
        ws_col: size.cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: TIOCSWINSZ reads one `struct winsize`, and `ws` is one, alive for the call; the ioctl
    // writes nothing of ours. `fd` is a terminal master the caller keeps open (its `Arc<OwnedFd>`).
    unsafe { libc::ioctl(fd, libc::TIOCSWINSZ, &ws) };
}

/// Opens a terminal pair: (master, slave).
fn open_terminal(size: WindowSize) -> std::io::Result<(OwnedFd, OwnedFd)> {
    let (mut master, mut slave) = (-1, -1);
    let ws = libc::winsize {
        ws_row: size.rows,
        ws_col: size.cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: openpty writes the two new fds into `master` and `slave` (live locals) and reads
    // `ws`, a valid winsize alive for the call; a null name buffer (no name wanted) and a null
    // termios (default settings) are allowed.
    let rc = unsafe {
        libc::openpty(
            &mut master,
            &mut slave,
            std::ptr::null_mut(),
            std::ptr::null(),
            &ws,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: openpty succeeded, so `master` and `slave` are two new open fds that nothing else
    // owns; F_SETFD takes an integer argument, and each fd is handed to exactly one OwnedFd, which
    // closes it.
    unsafe {
        libc::fcntl(master, libc::F_SETFD, libc::FD_CLOEXEC);
        libc::fcntl(slave, libc::F_SETFD, libc::FD_CLOEXEC);
        Ok((OwnedFd::from_raw_fd(master), OwnedFd::from_raw_fd(slave)))
    }
}

/// The command for `spec`: its argv, environment and working directory, stdio (pipes, or a
/// terminal whose master side is answered), and what the child does before exec.
fn command(spec: &Spawn) -> Result<(Command, Option<Arc<OwnedFd>>), Failure> {
    let Some(program) = spec.argv.first() else {
        return Err(Failure::new("invalid", "spawn needs a program"));
    };
    let mut command = Command::new(program);
    command
        .args(&spec.argv[1..])
        .env_clear()
        .envs(spec.env.iter().map(|(k, v)| (k, v)))
        .current_dir(&spec.cwd);
    let terminal = match spec.terminal {
        Some(size) => {
            let (master, slave) = open_terminal(size).map_err(|e| Failure::io("openpty", &e))?;
            let clone = |fd: &OwnedFd| {
                fd.try_clone()
                    .map(Stdio::from)
                    .map_err(|e| Failure::io("dup", &e))
            };
            command
                .stdin(clone(&slave)?)
                .stdout(clone(&slave)?)
                .stderr(Stdio::from(slave));
            Some(Arc::new(master))
        }
        None => {
            command
                .stdin(if spec.stdin {
                    Stdio::piped()
                } else {
                    Stdio::null()
                })
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            None
        }
    };
    let user = spec.user;
    let on_terminal = terminal.is_some();
    // SAFETY: the hook runs in the forked child before exec, where the parent's other threads are
    // gone and only async-signal-safe work is sound: it allocates nothing and takes no locks,
    // making only direct system calls (sigemptyset on a zeroed local sigset_t, which is plain data;
    // pthread_sigmask with a null old mask; setsid; ioctl TIOCSCTTY on fd 0, the terminal's slave;
    // and prctl, setgroups, setresgid, setresuid in `drop_privileges`). `io::Error::last_os_error`
    // reads errno without allocating; the captured `user` and `on_terminal` are Copy.
    unsafe {
        command.pre_exec(move || {
            let mut empty: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut empty);
            libc::pthread_sigmask(libc::SIG_SETMASK, &empty, std::ptr::null_mut());
            if libc::setsid() < 0 {
                return Err(std::io::Error::last_os_error());
            }
            if on_terminal && libc::ioctl(0, libc::TIOCSCTTY, 0) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            if let Some(user) = user {
                drop_privileges(user.uid, user.gid)?;
            }
            Ok(())
        });
    }
    Ok((command, terminal))
}

fn spawn(agent: &Arc<Agent>, id: u64, spec: Spawn) -> Result<(), Failure> {
    let (mut command, terminal) = command(&spec)?;
    let program = &spec.argv[0];
    // The threads that read the process's output start first, waiting for its streams: a
    // process that fills the box's pids limit at once (a fork bomb) cannot then leave the
    // agent without a thread to read it, and a box already full is told before anything
    // starts.
    let mut readers = Vec::new();
    for _ in 0..if terminal.is_some() { 1 } else { 2 } {
        let (give, take) = std::sync::mpsc::channel::<(bool, OwnedFd)>();
        let worker = agent.clone();
        thread(move || {
            if let Ok((stderr, fd)) = take.recv() {
                pump(&worker, id, stderr, fd);
            }
        })?;
        readers.push(give);
    }
    // Held across the fork so the reaper cannot take the child before it is in the table.
    let mut table = agent.table();
    let mut child = command.spawn().map_err(|e| match e.raw_os_error() {
        Some(libc::ENOENT) => Failure::new(
            "not_found",
            format!("{program}: command not found (or the working directory is missing)"),
        ),
        _ => Failure::io(&format!("starting {program}"), &e),
    })?;
    let pid = child.id() as i32;
    let mut streams = Vec::new();
    let stdin = match (&terminal, child.stdin.take()) {
        (Some(master), _) => Some(writer(master.try_clone().ok().map(std::fs::File::from))),
        (None, Some(pipe)) => Some(writer(Some(std::fs::File::from(OwnedFd::from(pipe))))),
        (None, None) => None,
    };
    match &terminal {
        Some(master) => {
            if let Ok(fd) = master.try_clone() {
                streams.push((false, fd));
            }
        }
        None => {
            if let Some(out) = child.stdout.take() {
                streams.push((false, OwnedFd::from(out)));
            }
            if let Some(err) = child.stderr.take() {
                streams.push((true, OwnedFd::from(err)));
            }
        }
    }
    table.procs.insert(
        id,
        Proc {
            pid,
            stdin,
            terminal,
            open_streams: streams.len() as u8,
            status: None,
            exited_at: None,
        },
    );
    table.by_pid.insert(pid, id);
    drop(table);
    // The child is reaped by the signal thread; dropping `Child` does not wait.
    drop(child);
    send(&agent.out, id, Reply::Spawned { pid: pid as u32 });
    // Each stream to a reader already waiting (a reader left without one ends).
    for (give, stream) in readers.into_iter().zip(streams) {
        let _ = give.send(stream);
    }
    Ok(())
}

/// In the child, before exec: no capabilities can come back, no supplementary groups, then
/// the user's gid and uid.
fn drop_privileges(uid: u32, gid: u32) -> std::io::Result<()> {
    // SAFETY: prctl, setresgid and setresuid take only integers; setgroups reads a list of `size`
    // gids, and with size 0 a null list is allowed. None touches memory of ours, and each is a
    // direct system call, so this is also sound in the forked child (`command`'s pre_exec hook
    // calls it there).
    unsafe {
        // Empties the bounding set so nothing (a setuid binary, file capabilities) regains
        // a capability; fails harmlessly where the agent lacks CAP_SETPCAP.
        for cap in 0..=63 {
            libc::prctl(libc::PR_CAPBSET_DROP, cap, 0, 0, 0);
        }
        libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0);
        if libc::setgroups(0, std::ptr::null()) < 0
            || libc::setresgid(gid, gid, gid) < 0
            || libc::setresuid(uid, uid, uid) < 0
        {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// A thread that writes what it is sent to `file`; the sender's drop closes it.
fn writer(file: Option<std::fs::File>) -> mpsc::Sender<Vec<u8>> {
    let (tx, rx) = mpsc::channel::<Vec<u8>>();
    if let Some(mut file) = file {
        // Without a writer thread the stdin bytes are dropped (the process reads end of
        // file): a box at its pids limit.
        let _ = thread(move || {
            for data in rx {
                if file.write_all(&data).is_err() {
                    break;
                }
            }
        });
    }
    tx
}

/// Forwards one output stream of process `id` until it ends (or, after the process exited,
/// until [`DRAIN_AFTER_EXIT`] passes).
fn pump(agent: &Agent, id: u64, stderr: bool, fd: OwnedFd) {
    let mut file = std::fs::File::from(fd);
    let mut buf = vec![0u8; proto::CHUNK_BYTES];
    loop {
        let mut poll = libc::pollfd {
            fd: file.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: `poll` is one valid, writable pollfd alive for the call (nfds is 1); its fd is
        // `file`'s, open while `file` lives.
        let ready = unsafe { libc::poll(&mut poll, 1, 50) };
        if ready == 0 {
            if agent.drained(id) {
                break;
            }
            continue;
        }
        match file.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => send(
                &agent.out,
                id,
                Reply::Output {
                    stderr,
                    data: buf[..n].to_vec(),
                },
            ),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            // EIO: the terminal's other side closed.
            Err(_) => break,
        }
    }
    agent.stream_closed(id);
}

/// Connects to a port inside the box, on a thread of its own.
fn connect(agent: &Arc<Agent>, id: u64, port: u16) {
    let worker = agent.clone();
    let started = thread(move || match TcpStream::connect(("127.0.0.1", port)) {
        Ok(stream) => carry(&worker, id, stream, (id, Reply::Connected)),
        Err(e) => send(
            &worker.out,
            id,
            Reply::Failed(Failure::io(&format!("connecting to port {port}"), &e)),
        ),
    });
    if let Err(failure) = started {
        send(&agent.out, id, Reply::Failed(failure));
    }
}

/// Listens on a port inside the box; each connection becomes a stream of its own.
fn listen(agent: &Arc<Agent>, id: u64, port: u16) {
    match std::net::TcpListener::bind(("127.0.0.1", port)) {
        Ok(listener) => {
            send(&agent.out, id, Reply::Listening);
            let worker = agent.clone();
            if let Err(failure) = thread(move || accept(&worker, id, listener)) {
                send(&agent.out, id, Reply::Failed(failure));
            }
        }
        Err(e) => send(
            &agent.out,
            id,
            Reply::Failed(Failure::io(&format!("listening on port {port}"), &e)),
        ),
    }
}

/// Accepts connections on a listener, each carried as a stream of its own.
fn accept(agent: &Arc<Agent>, id: u64, listener: std::net::TcpListener) {
    let mut next = 0u64;
    for stream in listener.incoming() {
        let Ok(stream) = stream else { continue };
        next += 1;
        let conn = proto::AGENT_ID_BIT | (id << 24) | (next & 0xff_ffff);
        let worker = agent.clone();
        // A box at its pids limit: the connection is dropped (its client sees it close).
        let _ = thread(move || carry(&worker, conn, stream, (id, Reply::Accepted { conn })));
    }
}

/// Carries a TCP connection over the channel as stream `id`: the peer's bytes go out as
/// `Output`, `Stdin` frames to `id` come in, and `Closed` ends it. `announce` (`Connected`,
/// `Accepted`) is sent once the stream can take the host's bytes, never before.
fn carry(agent: &Agent, id: u64, stream: TcpStream, announce: (u64, Reply)) {
    let (tx, rx) = mpsc::channel::<Vec<u8>>();
    agent.table().conns.insert(id, tx);
    send(&agent.out, announce.0, announce.1);
    if let Ok(mut write_half) = stream.try_clone() {
        let _ = thread(move || {
            for data in rx {
                if write_half.write_all(&data).is_err() {
                    break;
                }
            }
            let _ = write_half.shutdown(Shutdown::Write);
        });
    }
    let mut read_half = stream;
    let mut buf = vec![0u8; proto::CHUNK_BYTES];
    loop {
        match read_half.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => send(
                &agent.out,
                id,
                Reply::Output {
                    stderr: false,
                    data: buf[..n].to_vec(),
                },
            ),
        }
    }
    agent.table().conns.remove(&id);
    send(&agent.out, id, Reply::Closed);
}

/// A restored clone's own randomness and time: `seed` credited to the kernel's pool
/// (`RNDADDENTROPY`) and the pool reseeded now (`RNDRESEEDCRNG`), so no two clones of one
/// snapshot draw the same numbers; the clock set to `now_ms`.
fn thaw(seed: &[u8], now_ms: u64) -> Result<(), Failure> {
    const RNDADDENTROPY: libc::c_ulong = 0x4008_5203;
    const RNDRESEEDCRNG: libc::c_ulong = 0x5207;
    let failed =
        |what: &str| Failure::new("io", format!("{what}: {}", std::io::Error::last_os_error()));
    let when = libc::timespec {
        tv_sec: (now_ms / 1000) as libc::time_t,
        tv_nsec: ((now_ms % 1000) * 1_000_000) as libc::c_long,
    };
    // SAFETY: clock_settime reads one timespec, a live local.
    if unsafe { libc::clock_settime(libc::CLOCK_REALTIME, &when) } != 0 {
        return Err(failed("setting the clock"));
    }
    let bytes = seed.len().min(512);
    // struct rand_pool_info { int entropy_count; int buf_size; __u32 buf[]; }
    let mut info = Vec::with_capacity(8 + bytes);
    info.extend_from_slice(&((bytes * 8) as i32).to_ne_bytes());
    info.extend_from_slice(&(bytes as i32).to_ne_bytes());
    info.extend_from_slice(&seed[..bytes]);
    let device = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/urandom")
        .map_err(|e| Failure::new("io", format!("/dev/urandom: {e}")))?;
    use std::os::fd::AsRawFd;
    // SAFETY: RNDADDENTROPY reads a rand_pool_info of `8 + bytes` bytes from `info`, which holds
    // exactly that; RNDRESEEDCRNG takes no argument. `device` is open for the calls.
    unsafe {
        if libc::ioctl(device.as_raw_fd(), RNDADDENTROPY as _, info.as_ptr()) != 0 {
            return Err(failed("adding entropy"));
        }
        if libc::ioctl(device.as_raw_fd(), RNDRESEEDCRNG as _, 0) != 0 {
            return Err(failed("reseeding"));
        }
    }
    Ok(())
}
