//! The agent, run as its own process (not in a box) and driven over its stdin and stdout as
//! the host drives it.

use std::io::Write;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

use kiln_guest::proto::{self, EntryKind, Op, Reply, Request, Response, Spawn, WindowSize};

struct Agent {
    child: Child,
    input: ChildStdin,
    output: ChildStdout,
    next: u64,
}

impl Agent {
    fn start() -> Agent {
        let mut child = Command::new(env!("CARGO_BIN_EXE_kiln-guest"))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        // A test waiting on an answer that never comes fails (its read sees the channel
        // close) instead of hanging the suite.
        let pid = child.id() as i32;
        std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_secs(60));
            // SAFETY: kill(2) takes only integers and touches no memory of ours. `pid` is the agent
            // this test spawned; should the test have ended and `Agent`'s drop have reaped it
            // already, the pid could by then name another process, which this test-only watchdog
            // would kill (a flaw of the watchdog, not of memory safety).
            unsafe { libc::kill(pid, libc::SIGKILL) };
        });
        Agent {
            input: child.stdin.take().unwrap(),
            output: child.stdout.take().unwrap(),
            child,
            next: 1,
        }
    }

    fn send(&mut self, op: Op) -> u64 {
        let id = self.next;
        self.next += 1;
        proto::write_frame(&mut self.input, &Request { id, op }).unwrap();
        id
    }

    fn recv(&mut self) -> Response {
        proto::read_frame(&mut self.output).unwrap()
    }

    /// Replies for `id` until one that ends it (Exited, Done, Failed, Closed, Hello).
    fn until_end(&mut self, id: u64) -> Vec<Reply> {
        let mut replies = Vec::new();
        loop {
            let response = self.recv();
            assert_eq!(response.id, id, "{response:?}");
            let end = matches!(
                response.reply,
                Reply::Exited { .. }
                    | Reply::Done
                    | Reply::Failed(_)
                    | Reply::Closed
                    | Reply::Hello { .. }
            );
            replies.push(response.reply);
            if end {
                return replies;
            }
        }
    }

    fn run(&mut self, argv: &[&str], stdin: bool) -> (String, String, Reply, u64) {
        let id = self.send(Op::Spawn(spawn(argv, stdin)));
        let replies = self.until_end(id);
        let (out, err, end) = collect(replies);
        (out, err, end, id)
    }
}

fn spawn(argv: &[&str], stdin: bool) -> Spawn {
    Spawn {
        argv: argv.iter().map(|s| s.to_string()).collect(),
        env: vec![("PATH".into(), "/usr/bin:/bin".into())],
        cwd: "/".into(),
        user: None,
        terminal: None,
        stdin,
    }
}

fn collect(replies: Vec<Reply>) -> (String, String, Reply) {
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let mut end = None;
    for reply in replies {
        match reply {
            Reply::Output {
                stderr: false,
                data,
            } => out.extend(data),
            Reply::Output { stderr: true, data } => err.extend(data),
            Reply::Spawned { .. } => {}
            other => end = Some(other),
        }
    }
    (
        String::from_utf8_lossy(&out).into_owned(),
        String::from_utf8_lossy(&err).into_owned(),
        end.unwrap(),
    )
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn it_says_hello_and_runs_processes_with_their_output_and_exit_status() {
    let mut agent = Agent::start();
    let id = agent.send(Op::Hello);
    assert!(matches!(
        agent.until_end(id)[..],
        [Reply::Hello { version: 1, .. }]
    ));

    let (out, err, end, _) = agent.run(&["sh", "-c", "echo out; echo err >&2; exit 3"], false);
    assert_eq!((out.as_str(), err.as_str()), ("out\n", "err\n"));
    assert_eq!(
        end,
        Reply::Exited {
            code: Some(3),
            signal: None
        }
    );

    // The environment is exactly the one given.
    let (out, _, _, _) = agent.run(&["sh", "-c", "env | sort"], false);
    assert_eq!(out, "PATH=/usr/bin:/bin\nPWD=/\n");

    // A program that is not there is a clear failure, not a hang.
    let (_, _, end, _) = agent.run(&["no-such-program-xyz"], false);
    let Reply::Failed(failure) = end else {
        panic!("{end:?}")
    };
    assert_eq!(failure.kind, "not_found");
    assert!(
        failure.message.contains("no-such-program-xyz"),
        "{failure:?}"
    );

    // A background child holding the pipe does not keep the exec open.
    let started = std::time::Instant::now();
    let (out, _, end, _) = agent.run(&["sh", "-c", "sleep 5 & echo done"], false);
    assert_eq!(out, "done\n");
    assert!(matches!(end, Reply::Exited { code: Some(0), .. }));
    assert!(started.elapsed() < std::time::Duration::from_secs(3));
}

#[test]
fn stdin_signals_and_concurrent_processes() {
    let mut agent = Agent::start();
    let cat = agent.send(Op::Spawn(spawn(&["cat"], true)));
    let sleeper = agent.send(Op::Spawn(spawn(&["sleep", "30"], false)));
    agent.send(Op::Stdin {
        target: cat,
        data: b"hello ".to_vec(),
        eof: false,
    });
    agent.send(Op::Stdin {
        target: cat,
        data: b"agent".to_vec(),
        eof: true,
    });
    agent.send(Op::Signal {
        target: sleeper,
        signal: libc::SIGKILL,
    });
    let mut cat_out = Vec::new();
    let mut ended = std::collections::HashMap::new();
    while ended.len() < 2 {
        let Response { id, reply } = agent.recv();
        match reply {
            Reply::Output { data, .. } if id == cat => cat_out.extend(data),
            Reply::Exited { code, signal } => {
                ended.insert(id, (code, signal));
            }
            Reply::Spawned { .. } => {}
            other => panic!("{id}: {other:?}"),
        }
    }
    assert_eq!(cat_out, b"hello agent");
    assert_eq!(ended[&cat], (Some(0), None));
    assert_eq!(ended[&sleeper], (None, Some(libc::SIGKILL)));
}

#[test]
fn a_terminal_has_its_size_and_is_resized() {
    let mut agent = Agent::start();
    let mut request = spawn(&["sh", "-c", "stty size; read x; stty size"], true);
    request.terminal = Some(WindowSize { rows: 24, cols: 80 });
    let id = agent.send(Op::Spawn(request));
    // Wait for the first size before resizing.
    let mut seen = String::new();
    while !seen.contains("24 80") {
        if let Reply::Output { data, .. } = agent.recv().reply {
            seen.push_str(&String::from_utf8_lossy(&data));
        }
    }
    agent.send(Op::Resize {
        target: id,
        size: WindowSize {
            rows: 50,
            cols: 132,
        },
    });
    agent.send(Op::Stdin {
        target: id,
        data: b"go\n".to_vec(),
        eof: false,
    });
    let (out, _, end) = collect(agent.until_end(id));
    assert!(out.contains("50 132"), "{out:?}");
    assert!(
        matches!(end, Reply::Exited { code: Some(0), .. }),
        "{end:?}"
    );
}

#[test]
fn files_are_written_read_listed_and_removed_and_fifos_never_stall_it() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().to_str().unwrap().to_string();
    let mut agent = Agent::start();
    let file = format!("{root}/sub/data.bin");
    let id = agent.send(Op::MakeDir {
        path: format!("{root}/sub"),
        parents: true,
        owner: None,
    });
    assert_eq!(agent.until_end(id), [Reply::Done]);
    let data: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
    let id = agent.send(Op::WriteFile {
        path: file.clone(),
        data: data.clone(),
        append: false,
        mode: 0o600,
        owner: None,
    });
    assert_eq!(agent.until_end(id), [Reply::Done]);
    let id = agent.send(Op::ReadFile {
        path: file.clone(),
        offset: 10,
        limit: 150_000,
    });
    let mut back = Vec::new();
    for reply in agent.until_end(id) {
        match reply {
            Reply::Data { data } => back.extend(data),
            Reply::Done => {}
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(back, data[10..150_010]);

    std::os::unix::fs::symlink("/etc", format!("{root}/link")).unwrap();
    let id = agent.send(Op::List { path: root.clone() });
    let mut names = Vec::new();
    for reply in agent.until_end(id) {
        if let Reply::Entries { entries } = reply {
            names.extend(entries.into_iter().map(|e| (e.name, e.kind, e.target)));
        }
    }
    names.sort();
    assert_eq!(
        names,
        [
            (
                "link".to_string(),
                EntryKind::Symlink,
                Some("/etc".to_string())
            ),
            ("sub".to_string(), EntryKind::Dir, None)
        ]
    );

    // A fifo is refused at once, for reading and for writing.
    let fifo = format!("{root}/fifo");
    let c = std::ffi::CString::new(fifo.clone()).unwrap();
    // SAFETY: `c` is a NUL-terminated CString alive for the call, which only reads it.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
    let id = agent.send(Op::ReadFile {
        path: fifo.clone(),
        offset: 0,
        limit: 10,
    });
    assert!(matches!(&agent.until_end(id)[..], [Reply::Failed(f)] if f.kind == "invalid"));
    let id = agent.send(Op::WriteFile {
        path: fifo,
        data: b"x".to_vec(),
        append: false,
        mode: 0o644,
        owner: None,
    });
    assert!(matches!(&agent.until_end(id)[..], [Reply::Failed(_)]));

    let id = agent.send(Op::Remove {
        path: format!("{root}/sub"),
    });
    assert_eq!(agent.until_end(id), [Reply::Done]);
    let id = agent.send(Op::Stat { path: file });
    assert!(matches!(&agent.until_end(id)[..], [Reply::Failed(f)] if f.kind == "not_found"));
}

#[test]
fn connections_to_ports_carry_bytes_both_ways() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let server = std::thread::spawn(move || {
        let (mut stream, _) = listener.accept().unwrap();
        let mut buf = [0u8; 5];
        std::io::Read::read_exact(&mut stream, &mut buf).unwrap();
        stream.write_all(&buf.to_ascii_uppercase()).unwrap();
    });
    let mut agent = Agent::start();
    let id = agent.send(Op::Connect { port });
    assert_eq!(agent.recv().reply, Reply::Connected);
    agent.send(Op::Stdin {
        target: id,
        data: b"hello".to_vec(),
        eof: true,
    });
    let mut got = Vec::new();
    for reply in agent.until_end(id) {
        if let Reply::Output { data, .. } = reply {
            got.extend(data);
        }
    }
    assert_eq!(got, b"HELLO");
    server.join().unwrap();

    // A closed port is a clear failure.
    let id = agent.send(Op::Connect { port: 1 });
    assert!(matches!(&agent.until_end(id)[..], [Reply::Failed(_)]));
}

#[test]
fn malformed_and_oversized_frames_are_answered_or_end_the_channel() {
    let mut agent = Agent::start();
    // A whole frame that is not a request: answered, and the agent goes on.
    let junk = b"{\"id\":1,\"op\":{\"launch\":1}}";
    agent
        .input
        .write_all(&(junk.len() as u32).to_le_bytes())
        .unwrap();
    agent.input.write_all(junk).unwrap();
    assert!(matches!(agent.recv().reply, Reply::Failed(f) if f.kind == "invalid"));
    let id = agent.send(Op::Hello);
    assert!(matches!(agent.until_end(id)[..], [Reply::Hello { .. }]));
    // An oversized length ends the channel: the agent exits with an error, not a 4 GiB read.
    agent.input.write_all(&u32::MAX.to_le_bytes()).unwrap();
    let status = agent.child.wait().unwrap();
    assert!(!status.success());
}

#[test]
fn a_listener_carries_each_accepted_connection_as_its_own_stream() {
    let mut agent = Agent::start();
    // A free port, found by binding port 0; another process may take it before the agent
    // listens (tests run side by side), so a port found busy is tried again with another.
    let (port, listen) = (0..10)
        .find_map(|_| {
            let port = {
                let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
                probe.local_addr().unwrap().port()
            };
            let listen = agent.send(Op::Listen { port });
            match agent.recv() {
                Response {
                    id,
                    reply: Reply::Listening,
                } if id == listen => Some((port, listen)),
                Response {
                    id,
                    reply: Reply::Failed(f),
                } if id == listen && f.message.contains("listening") => None,
                other => panic!("{other:?}"),
            }
        })
        .expect("a free port within 10 tries");
    let client = std::thread::spawn(move || {
        let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        stream.write_all(b"ping").unwrap();
        let mut back = String::new();
        std::io::Read::read_to_string(&mut stream, &mut back).unwrap();
        back
    });
    let Response {
        id,
        reply: Reply::Accepted { conn },
    } = agent.recv()
    else {
        panic!("no accept")
    };
    assert_eq!(id, listen);
    assert_ne!(conn & proto::AGENT_ID_BIT, 0);
    let mut got = Vec::new();
    while got.len() < 4 {
        let Response { id, reply } = agent.recv();
        assert_eq!(id, conn);
        let Reply::Output { data, .. } = reply else {
            panic!("{reply:?}")
        };
        got.extend(data);
    }
    assert_eq!(got, b"ping");
    agent.send(Op::Stdin {
        target: conn,
        data: b"pong".to_vec(),
        eof: true,
    });
    assert_eq!(client.join().unwrap(), "pong");
    assert_eq!(
        agent.recv(),
        Response {
            id: conn,
            reply: Reply::Closed
        }
    );

    // A port in use is a clear failure.
    let again = agent.send(Op::Listen { port });
    assert!(
        matches!(&agent.until_end(again)[..], [Reply::Failed(f)] if f.message.contains("listening"))
    );
}
