//! kiln's process-level integration tests, in one binary: each module starts real `kiln`
//! processes (the CLI, `kiln serve`, `kiln rest`, `kiln runner`) and talks to them as users
//! do. Run one part with `cargo test -p kiln --test it serve::`.

mod all;
mod chat;
mod cluster;
mod common;
mod egress;
mod fork;
mod interactive;
mod issue32;
mod keys;
mod lifecycle;
mod linux;
mod rest;
mod rich_oneshot;
mod runner;
mod serve;
mod snapshots;
mod storage;
mod volumes;
mod worker_jail;
mod workflows;
mod workspaces;
