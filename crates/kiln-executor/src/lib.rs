//! Executor processes. Untrusted code never runs in a process that holds HTTP connections
//! or secrets: a pool in the parent drives worker processes (the `kiln` binary started as
//! `kiln __worker`) over their stdin and stdout.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use kiln_core::{ExecRequest, Language};
//! use kiln_executor::{ExecutorPool, PoolConfig};
//!
//! let pool = ExecutorPool::new(PoolConfig::current_exe()?);
//! let result = pool.execute(ExecRequest::new(Language::Python, "print(6 * 7)")).await?;
//! assert_eq!(result.stdout, b"42\n");
//! # Ok(()) }
//! ```

pub mod confine;
pub mod fair;
#[cfg(any(test, feature = "fake-backend"))]
pub mod fake;
pub mod pool;
pub mod protocol;
pub mod worker;

pub use kiln_core::backend::{Door, DoorFuture};
pub use pool::{
    BeforeSend, CallOptions, Chunk, ExecutorPool, InProcess, PoolConfig, PoolError, SessionHandle,
    WorkerLoad,
};
pub use protocol::{RemoteError, Share};
