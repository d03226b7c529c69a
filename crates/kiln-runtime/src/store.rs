//! Durable writes of the server's own files: see [`kiln_workspace::store`].

pub use kiln_workspace::store::*;
