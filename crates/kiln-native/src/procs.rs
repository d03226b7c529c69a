//! A box's processes as the box sees them, read by the host from `/proc` (its pids from
//! each task's `NSpid`, its uids shifted back), and signals to them by the box's pids.
//! Nothing here asks the agent, so it works while a box is paused.
//!
//! What `/proc` says of a box's process is the box's to choose (its command line, its
//! name): every read is capped, and names are taken as bytes, never as paths.

use std::io::Read;

use kiln_core::process::BoxProcess;

/// The longest command line read of a process.
pub(crate) const MAX_CMDLINE: u64 = 4 << 10;

/// A task of the box: its host pid and what the box sees.
#[derive(Debug, Clone)]
pub(crate) struct Task {
    pub host_pid: i32,
    /// Its process group, as the host numbers it.
    pub host_pgid: i32,
    pub process: BoxProcess,
}

fn read_capped(path: &str, cap: u64) -> Option<Vec<u8>> {
    let mut bytes = Vec::new();
    std::fs::File::open(path)
        .ok()?
        .take(cap)
        .read_to_end(&mut bytes)
        .ok()?;
    Some(bytes)
}

/// The host's boot time (seconds since the epoch) and clock ticks per second.
fn clock() -> (u64, u64) {
    let boot = std::fs::read_to_string("/proc/stat")
        .ok()
        .and_then(|text| {
            text.lines()
                .find_map(|l| l.strip_prefix("btime ")?.trim().parse().ok())
        })
        .unwrap_or(0);
    // SAFETY: sysconf(3) takes an integer name and touches no memory of ours.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    (boot, u64::try_from(ticks).unwrap_or(100).max(1))
}

/// Reads one task of the box; `None` when it is gone (or is not the box's).
fn task(host_pid: i32, uid_base: u32, boot: u64, ticks: u64, page: u64) -> Option<Task> {
    let status =
        String::from_utf8(read_capped(&format!("/proc/{host_pid}/status"), 16 << 10)?).ok()?;
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .map(str::trim)
    };
    // The innermost pid namespace's number is the box's.
    let pid: u32 = field("NSpid")?.split_whitespace().last()?.parse().ok()?;
    let uid: u32 = field("Uid")?.split_whitespace().nth(1)?.parse().ok()?;
    let stat = read_capped(&format!("/proc/{host_pid}/stat"), 4 << 10)?;
    // `pid (name) state ppid pgrp …`: the name may hold spaces and parentheses, so it
    // ends at the last ')'.
    let open = stat.iter().position(|b| *b == b'(')?;
    let close = stat.iter().rposition(|b| *b == b')')?;
    let name = String::from_utf8_lossy(stat.get(open + 1..close)?).into_owned();
    let rest = String::from_utf8_lossy(stat.get(close + 1..)?).into_owned();
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // Fields from the state on (stat(5)'s field 3 is fields[0]).
    let number = |n: usize| fields.get(n - 3).and_then(|v| v.parse::<u64>().ok());
    let state = fields.first()?.to_string();
    let host_pgid = i32::try_from(number(5)?).ok()?;
    let cpu_ticks = number(14)? + number(15)?;
    let started_ticks = number(22)?;
    let rss_pages = number(24)?;
    let argv = read_capped(&format!("/proc/{host_pid}/cmdline"), MAX_CMDLINE)
        .unwrap_or_default()
        .split(|b| *b == 0)
        .filter(|a| !a.is_empty())
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    Some(Task {
        host_pid,
        host_pgid,
        process: BoxProcess {
            pid,
            ppid: 0,
            pgid: 0,
            uid: uid.saturating_sub(uid_base),
            name,
            argv,
            state,
            started_ms: boot * 1000 + started_ticks * 1000 / ticks,
            cpu_ms: cpu_ticks * 1000 / ticks,
            memory_bytes: rss_pages * page,
            agent: pid == 1,
        },
    })
}

/// A process of a microVM, from its `/proc/PID/stat`, `status` and `cmdline` as the agent
/// read them: its process, parent and group (the VM's numbers are its own: no mapping).
/// `boot` is the VM's boot time in seconds since the epoch; the VM's clock ticks at 100 Hz
/// (x86's USER_HZ) and its pages are 4 KiB.
pub fn vm_process(
    pid: u32,
    stat: &[u8],
    status: &str,
    cmdline: &[u8],
    boot: u64,
) -> Option<BoxProcess> {
    const TICKS: u64 = 100;
    const PAGE: u64 = 4096;
    let uid: u32 = status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()?;
    let open = stat.iter().position(|b| *b == b'(')?;
    let close = stat.iter().rposition(|b| *b == b')')?;
    let name = String::from_utf8_lossy(stat.get(open + 1..close)?).into_owned();
    let rest = String::from_utf8_lossy(stat.get(close + 1..)?).into_owned();
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let number = |n: usize| fields.get(n - 3).and_then(|v| v.parse::<u64>().ok());
    Some(BoxProcess {
        pid,
        ppid: u32::try_from(number(4)?).ok()?,
        pgid: u32::try_from(number(5)?).ok()?,
        uid,
        name,
        argv: cmdline
            .split(|b| *b == 0)
            .filter(|a| !a.is_empty())
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect(),
        state: fields.first()?.to_string(),
        // The guest writes these numbers: saturated, never an overflow.
        started_ms: boot
            .saturating_mul(1000)
            .saturating_add(number(22)?.saturating_mul(1000) / TICKS),
        cpu_ms: number(14)?.saturating_add(number(15)?).saturating_mul(1000) / TICKS,
        memory_bytes: number(24)?.saturating_mul(PAGE),
        agent: pid == 1,
    })
}

/// The listening sockets in a microVM's `/proc/net/tcp` (`v6`: `tcp6`) text, each with its
/// socket inode (to find its owner by the VM's `/proc/PID/fd` links).
pub fn vm_listening(text: &str, v6: bool) -> Vec<(kiln_core::process::BoxPort, String)> {
    let mut found = Vec::new();
    for line in text.lines().skip(1) {
        let fields: Vec<&str> = line.split_whitespace().collect();
        if fields.len() < 10 || fields[3] != "0A" {
            continue;
        }
        let Some((address, port)) = fields[1].split_once(':') else {
            continue;
        };
        let (Ok(port), Some(ip)) = (u16::from_str_radix(port, 16), hex_address(address, v6)) else {
            continue;
        };
        let reachable = ip.is_unspecified()
            || ip.is_loopback()
            || matches!(ip, std::net::IpAddr::V6(v6) if v6.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback()));
        found.push((
            kiln_core::process::BoxPort {
                port,
                address: ip.to_string(),
                reachable,
                pid: None,
                name: None,
            },
            fields[9].to_string(),
        ));
    }
    found
}

/// The tasks of the box whose processes (host pids, thread group leaders) are `host_pids`,
/// ordered by the box's pid, each with its parent and group in the box's numbers.
pub(crate) fn tasks(host_pids: &[i32], uid_base: u32) -> Vec<Task> {
    let (boot, ticks) = clock();
    // SAFETY: sysconf(3) takes an integer name and touches no memory of ours.
    let page = u64::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096);
    let mut tasks: Vec<Task> = host_pids
        .iter()
        .filter_map(|pid| task(*pid, uid_base, boot, ticks, page))
        .collect();
    let box_pid = |host: i32| {
        tasks
            .iter()
            .find(|t| t.host_pid == host)
            .map(|t| t.process.pid)
    };
    let mapped: Vec<(u32, u32)> = tasks
        .iter()
        .map(|t| {
            let ppid = std::fs::read_to_string(format!("/proc/{}/status", t.host_pid))
                .ok()
                .and_then(|s| {
                    s.lines()
                        .find_map(|l| l.strip_prefix("PPid:")?.trim().parse::<i32>().ok())
                })
                .and_then(box_pid)
                .unwrap_or(0);
            (ppid, box_pid(t.host_pgid).unwrap_or(0))
        })
        .collect();
    for (t, (ppid, pgid)) in tasks.iter_mut().zip(mapped) {
        t.process.ppid = ppid;
        t.process.pgid = pgid;
    }
    tasks.sort_by_key(|t| t.process.pid);
    tasks
}

/// The sockets listening in the network namespace of host process `net_pid` (the box's
/// agent), from its `/proc/PID/net/tcp` and `tcp6`, each with the task holding it.
pub(crate) fn listening(net_pid: i32, tasks: &[Task]) -> Vec<kiln_core::process::BoxPort> {
    let mut found = Vec::new();
    for (file, v6) in [("tcp", false), ("tcp6", true)] {
        let Some(text) = read_capped(&format!("/proc/{net_pid}/net/{file}"), 4 << 20) else {
            continue;
        };
        for line in String::from_utf8_lossy(&text).lines().skip(1) {
            let fields: Vec<&str> = line.split_whitespace().collect();
            // sl local_address rem_address st … inode (field 9)
            if fields.len() < 10 || fields[3] != "0A" {
                continue;
            }
            let Some((address, port)) = fields[1].split_once(':') else {
                continue;
            };
            let Ok(port) = u16::from_str_radix(port, 16) else {
                continue;
            };
            let Some(ip) = hex_address(address, v6) else {
                continue;
            };
            let reachable = ip.is_unspecified()
                || ip.is_loopback()
                || matches!(ip, std::net::IpAddr::V6(v6) if v6.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback()));
            let owner = socket_owner(fields[9], tasks);
            found.push(kiln_core::process::BoxPort {
                port,
                address: ip.to_string(),
                reachable,
                pid: owner.map(|t| t.process.pid),
                name: owner.map(|t| t.process.name.clone()),
            });
        }
    }
    found.sort_by(|a, b| (a.port, &a.address).cmp(&(b.port, &b.address)));
    found.dedup_by(|a, b| a.port == b.port && a.address == b.address);
    found
}

/// `/proc/net/tcp`'s address: the kernel's 32-bit words in host (little-endian) order.
fn hex_address(hex: &str, v6: bool) -> Option<std::net::IpAddr> {
    let words: Vec<u32> = (0..hex.len() / 8)
        .map(|i| u32::from_str_radix(hex.get(i * 8..i * 8 + 8)?, 16).ok())
        .collect::<Option<_>>()?;
    let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    match (v6, bytes.len()) {
        (false, 4) => Some(std::net::IpAddr::from(<[u8; 4]>::try_from(bytes).ok()?)),
        (true, 16) => Some(std::net::IpAddr::from(<[u8; 16]>::try_from(bytes).ok()?)),
        _ => None,
    }
}

/// The task with an open file descriptor on socket `inode`.
fn socket_owner<'a>(inode: &str, tasks: &'a [Task]) -> Option<&'a Task> {
    let wanted = format!("socket:[{inode}]");
    tasks.iter().find(|task| {
        std::fs::read_dir(format!("/proc/{}/fd", task.host_pid))
            .into_iter()
            .flatten()
            .flatten()
            .take(4096)
            .any(|fd| {
                std::fs::read_link(fd.path())
                    .is_ok_and(|target| target.as_os_str() == wanted.as_str())
            })
    })
}

/// Whether a thread of host process `pid` waits in `vfork` for its child to exec or exit
/// (its wait channel is `kernel_clone`, where the kernel parks a vfork parent).
pub fn in_vfork(pid: i32) -> bool {
    let Ok(threads) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    threads.flatten().any(|thread| {
        std::fs::read_to_string(thread.path().join("wchan"))
            .is_ok_and(|w| w.trim() == "kernel_clone")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_listening_socket_of_this_process_is_found_with_its_owner() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let me = std::process::id() as i32;
        let tasks = tasks(&[me], 0);
        let found = listening(me, &tasks);
        let ours = found.iter().find(|p| p.port == port).expect("listed");
        assert_eq!(ours.address, "127.0.0.1");
        assert!(ours.reachable);
        assert_eq!(ours.pid, Some(me as u32));
        assert_eq!(
            hex_address("00000000000000000000000001000000", true),
            Some("::1".parse().unwrap())
        );
        assert_eq!(
            hex_address("0100007F", false),
            Some("127.0.0.1".parse().unwrap())
        );
        assert_eq!(hex_address("zz", false), None);
    }

    #[test]
    fn this_process_reads_as_a_task_of_its_own_namespace() {
        let me = std::process::id() as i32;
        let found = tasks(&[me], 0);
        assert_eq!(found.len(), 1);
        let task = &found[0].process;
        // Not in a pid namespace of its own here: the innermost pid is the host's.
        assert_eq!(task.pid, me as u32);
        assert!(!task.argv.is_empty());
        assert!(task.memory_bytes > 0);
        let now_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64;
        assert!(task.started_ms <= now_ms + 1000 && task.started_ms > now_ms - 3_600_000);
        assert!(tasks(&[i32::MAX], 0).is_empty(), "a gone pid is left out");
    }

    /// A hostile VM's `/proc` text (read through its agent): numbers that would overflow
    /// saturate, malformed lines are skipped, nothing panics.
    #[test]
    fn a_vms_proc_text_with_huge_or_broken_numbers_is_read_without_overflow() {
        let max = u64::MAX;
        let stat =
            format!("7 (sh) S 1 7 7 0 -1 0 0 0 0 0 {max} {max} 0 0 20 0 1 0 {max} 0 {max} 0");
        let process = vm_process(
            7,
            stat.as_bytes(),
            "Uid:\t1000\t1000\t1000\t1000\n",
            b"sh\0",
            max,
        )
        .expect("a process");
        assert_eq!(
            (process.started_ms, process.cpu_ms, process.memory_bytes),
            (max, max / 100, max)
        );
        assert!(vm_process(7, b") (", "Uid: 1 1", b"", 0).is_none());
        assert!(vm_process(7, b"7 (x", "", b"", 0).is_none());
        assert!(
            vm_listening(
                "header\n  0: 0100007F:ZZZZ 00000000:0000 0A 0 0 0 0 0 0 0 1\n0: x",
                false
            )
            .is_empty()
        );
    }
}
