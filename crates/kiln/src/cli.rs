//! Every command-line flag, in one place.

use std::path::PathBuf;

use anyhow::bail;
use clap::{Args, Parser, Subcommand};
use kiln_core::{Language, Limits, Mount};

/// Exit codes kiln uses besides the guest's own.
pub mod exit_codes {
    /// kiln itself failed (setup, bad arguments it could not run with).
    pub const KILN_ERROR: u8 = 120;
    /// The guest spent its instruction budget (`--fuel`).
    pub const FUEL_EXHAUSTED: u8 = 121;
    /// The guest ran past its deadline.
    pub const TIMED_OUT: u8 = 124;
    /// The guest needed more memory than its cap.
    pub const MEMORY_LIMIT: u8 = 125;
    /// The guest trapped (the sandbox crashed).
    pub const CRASHED: u8 = 126;
}

/// kiln runs untrusted code — Python and JavaScript — in WebAssembly sandboxes, fast.
#[derive(Debug, Parser)]
#[command(name = "kiln", version, about, max_term_width = 100)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
    /// A kiln.toml to read settings from (default: ./kiln.toml if there is one). Flags and
    /// KILN_* variables override it; see `kiln config`.
    #[arg(long, global = true, env = "KILN_CONFIG", value_name = "FILE")]
    pub config: Option<PathBuf>,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run code given on the command line: `kiln exec --lang python -c 'print(1)'`.
    Exec(ExecArgs),
    /// Run a file; the language comes from its extension (.py, .js).
    Run {
        /// The script to run.
        file: PathBuf,
        #[command(flatten)]
        exec: ExecArgs,
    },
    /// Fetch, check and compile the runtimes now (otherwise done on first use); with
    /// --template, build Linux templates instead (debootstrap and apt-get, as root).
    Setup {
        /// Only this language.
        #[arg(long, value_parser = parse_language)]
        lang: Option<Language>,
        /// Also compile the runtimes for guests with an instruction budget (`--fuel`,
        /// `fuel` in an API request's limits), which otherwise compile on first use
        /// (Python: about 90 CPU-seconds and 2.7 GB of memory, once).
        #[arg(long)]
        fuel: bool,
        /// Build this Linux template (`debian`, `python`, `node`, `go`, an operator's, or
        /// `all`); repeatable. An unchanged template is never rebuilt.
        #[arg(long = "template")]
        templates: Vec<String>,
        /// Rebuild even if the template is built.
        #[arg(long, requires = "templates")]
        rebuild: bool,
        /// Afterwards, remove every compiled module and warm image in the cache that this
        /// setup did not prepare: those of older kiln versions and runtimes, of changed
        /// warm-ups, and fuel modules unless --fuel (anything removed that is needed again
        /// is rebuilt on first use). Without it, files unused for 14 days are removed.
        #[arg(long, conflicts_with = "templates")]
        prune: bool,
        #[command(flatten)]
        linux: LinuxArgs,
    },
    /// Serve the platform HTTP API (sandboxes, exec, sessions, files, history; docs at /docs).
    Serve(Box<ServeArgs>),
    /// Serve MCP (Model Context Protocol) over stdin/stdout: run_python, run_javascript,
    /// sessions and file tools for any MCP client. Needs no LLM.
    Mcp {
        /// Folder for sandboxes, workspaces and history (default: ~/.local/share/kiln).
        #[arg(long, env = "KILN_DATA_DIR")]
        data_dir: Option<PathBuf>,
        /// Executor worker processes.
        #[arg(long, default_value_t = 1)]
        workers: usize,
        /// The template of Python code where a tool names no sandbox: `python` (default) or
        /// `python-data` (numpy, pandas, scipy and matplotlib already imported).
        #[arg(long, env = "KILN_DEFAULT_PYTHON_TEMPLATE", value_name = "TEMPLATE")]
        default_python_template: Option<String>,
    },
    /// Manage API keys for `kiln serve` (stored hashed in the data folder).
    Keys {
        #[command(subcommand)]
        command: KeysCommand,
        /// Folder for workspaces and state (default: ~/.local/share/kiln).
        #[arg(long, env = "KILN_DATA_DIR", global = true)]
        data_dir: Option<PathBuf>,
    },
    /// Serve the dynamic REST metaservice: no fixed endpoints; a planner (an LLM, or the
    /// offline conventions planner) writes the code for each request, which runs in the
    /// tenant's sandbox over its JSON collections. `kiln rest plans` shows the plan cache.
    Rest(crate::rest_cmd::RestArgs),
    /// Serve the UHLP sandbox runner protocol (POST /execute) for a core framework.
    Runner(crate::runner_cmd::RunnerArgs),
    /// Measure kiln's latencies and throughput; prints JSON.
    Bench(BenchArgs),
    /// Say what this host can run, tier by tier (WebAssembly, Linux boxes under runc and
    /// gVisor, hibernation with CRIU, virtualisation for microVMs), and why not where it
    /// cannot. Starts nothing.
    Doctor {
        #[command(flatten)]
        linux: LinuxArgs,
        /// Print JSON instead of lines.
        #[arg(long)]
        json: bool,
    },
    /// Print a command's effective settings (flags > KILN_* environment > kiln.toml >
    /// defaults) as TOML, with where each came from; secrets are redacted.
    Config {
        /// The command whose settings to show.
        #[arg(default_value = "serve", value_parser = ["exec", "setup", "serve", "mcp", "rest", "runner", "bench"])]
        command: String,
    },
    /// Internal: serve as an executor worker on stdin/stdout.
    #[command(name = "__worker", hide = true)]
    Worker,
    /// Internal: confine this process as a worker would, and say whether it could.
    #[command(name = "__jail-probe", hide = true)]
    JailProbe,
}

#[derive(Debug, Args)]
pub struct ServeArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:3000", env = "KILN_LISTEN")]
    pub listen: std::net::SocketAddr,
    /// Folder for sandboxes, workspaces, history and keys (default: ~/.local/share/kiln).
    #[arg(long, env = "KILN_DATA_DIR")]
    pub data_dir: Option<PathBuf>,
    /// Executor worker processes (default: one per CPU).
    #[arg(long)]
    pub workers: Option<usize>,
    /// Serve without API keys: every caller is one tenant, `local`. For a machine of your
    /// own only; the server says so loudly at start.
    #[arg(long, env = "KILN_NO_AUTH", value_parser = clap::builder::BoolishValueParser::new())]
    pub no_auth: bool,
    /// Requests a second allowed per API key (bursts of twice that); 0 turns it off.
    #[arg(long, default_value_t = 200, env = "KILN_RATE_LIMIT")]
    pub rate_limit: u32,
    /// Seconds a request may take before it is answered with 408.
    #[arg(long, default_value_t = 600, env = "KILN_REQUEST_TIMEOUT")]
    pub request_timeout: u64,
    /// Log format: json (one object per line) or text. Default: json unless stderr is a
    /// terminal.
    #[arg(long, env = "KILN_LOG_FORMAT")]
    pub log_format: Option<LogFormat>,
    /// A host name clients use to reach this server (repeatable), for `/mcp`'s `Host` check
    /// against DNS rebinding; loopback names and the listen address are always accepted.
    #[arg(long = "public-host", value_name = "HOST")]
    pub public_hosts: Vec<String>,
    /// Each tenant's quotas (a key may have its own: `kiln keys create --max-…`). Without
    /// keys (`--no-auth`) the one tenant's defaults are the machine's capacity instead.
    #[command(flatten)]
    pub quotas: QuotaArgs,
    /// Executions of one tenant that may wait for a place when its executions quota is in
    /// use; one more is refused with 429.
    #[arg(long, default_value_t = 1024, env = "KILN_EXEC_QUEUE")]
    pub exec_queue: usize,
    /// Seconds one execution may wait in its tenant's line before it is refused with 429.
    #[arg(long, default_value_t = 60, env = "KILN_EXEC_QUEUE_WAIT")]
    pub exec_queue_wait: u64,
    /// Also serve Linux templates (`linux-python`, `linux-node`, `linux-go`, `linux-debian`,
    /// and Docker images such as python:3.11 and node:18) in live boxes. Needs root and the
    /// templates built (`kiln setup --template all`); templates not built are left out.
    #[arg(long, env = "KILN_LINUX", value_parser = clap::builder::BoolishValueParser::new())]
    pub linux: bool,
    /// The longest one execution may run, and the largest `timeoutMs` a request may ask
    /// (each execution is also bounded by its sandbox's remaining life).
    #[arg(long, env = "KILN_MAX_EXEC_TIME", default_value = "5m", value_parser = parse_duration_ms)]
    pub max_exec_time: u64,
    /// A cap on every sandbox's life from its creation, whatever renews it (`24h`, `7d`).
    /// Unset (the default): a sandbox without a fixed life (`timeoutMs`) lives until it
    /// idles `lifecycle.terminateAfterIdleMs` (default 7 days), however long that is.
    #[arg(long, env = "KILN_MAX_SANDBOX_LIFE", value_parser = parse_life_ms)]
    pub max_sandbox_life: Option<u64>,
    /// Be a node of a cluster whose state is in this Postgres (`postgres://user@host/db`):
    /// the node joins with a lease it renews, and the nodes share the directory of their
    /// sandboxes (see docs/cluster.md). Unset (the default): a server on its own.
    #[arg(long, env = "KILN_DATABASE", value_name = "URL")]
    pub database: Option<String>,
    /// This node's id in the cluster (default: the host's name).
    #[arg(long, env = "KILN_NODE_ID")]
    pub node_id: Option<String>,
    /// Where other nodes and clients reach this node (default: http:// and --listen).
    #[arg(long, env = "KILN_ADVERTISE", value_name = "URL")]
    pub advertise: Option<String>,
    /// How long the node's lease lasts without renewal before the cluster declares it
    /// lost with its sandboxes; it renews every third of it.
    #[arg(long, env = "KILN_NODE_LEASE", default_value = "10s", value_parser = parse_duration_ms)]
    pub node_lease: u64,
    /// Run a language's code in a template of your choice where a request names no sandbox
    /// (MCP's run tools, the chat agent, default sandboxes): `python=linux-python`,
    /// `javascript=linux-node`; repeatable. Default: the WebAssembly templates.
    #[arg(long = "route", env = "KILN_ROUTE", value_delimiter = ',', value_name = "LANG=TEMPLATE", value_parser = parse_route)]
    pub routes: Vec<(Language, String)>,
    /// The template of Python code where a request names no sandbox (MCP's run_python and
    /// session tools, the chat agent's execute_code, default sandboxes): `python` (default)
    /// or `python-data`, which starts warm with numpy, pandas, scipy and matplotlib
    /// imported. The same as `--route python=TEMPLATE`.
    #[arg(long, env = "KILN_DEFAULT_PYTHON_TEMPLATE", value_name = "TEMPLATE")]
    pub default_python_template: Option<String>,
    /// Also speak E2B's protocol on this address, so code written for E2B's SDKs runs
    /// here unchanged: point E2B_API_URL and E2B_SANDBOX_URL at it (see "Coming from E2B"
    /// in the README).
    #[arg(long, env = "KILN_E2B_LISTEN", value_name = "ADDRESS")]
    pub e2b_listen: Option<std::net::SocketAddr>,
    /// The domain of E2B_DOMAIN-style host names (`{port}-{id}.DOMAIN`) the E2B facade
    /// routes by; needs wildcard DNS (and TLS in front). Header routing needs none.
    #[arg(
        long,
        env = "KILN_E2B_DOMAIN",
        value_name = "DOMAIN",
        requires = "e2b_listen"
    )]
    pub e2b_domain: Option<String>,
    /// Serve previews by host name too: `{port}-{id}.DOMAIN` (the sandbox id without its
    /// `sb_`) reaches what the sandbox's box serves on that port, at its own root path, as
    /// `/preview/{id}/{port}/` does. Needs wildcard DNS for the domain (and TLS in front).
    #[arg(long, env = "KILN_PREVIEW_DOMAIN", value_name = "DOMAIN")]
    pub preview_domain: Option<String>,
    /// A folder of workflow templates (`*.yaml`) besides the built-in ones (`static-website`,
    /// `fullstack-app`, `database-schema`); one with a built-in's name replaces it.
    #[arg(long, env = "KILN_WORKFLOW_TEMPLATES", value_name = "DIR")]
    pub workflow_templates: Option<std::path::PathBuf>,
    #[command(flatten)]
    pub linux_args: LinuxArgs,
}

/// `LANG=TEMPLATE`.
fn parse_route(text: &str) -> Result<(Language, String), String> {
    let (language, template) = text
        .split_once('=')
        .ok_or_else(|| format!("a route is LANG=TEMPLATE (python=linux-python), not {text:?}"))?;
    let language = Language::from_name(language.trim())
        .ok_or_else(|| format!("unknown language {language:?}: python, javascript, go or bash"))?;
    Ok((language, template.trim().to_owned()))
}

/// Per-tenant quotas. For `kiln serve`, the defaults every key gets; for `kiln keys create`,
/// the key's own (unset: the server's).
#[derive(Debug, Clone, Default, Args)]
pub struct QuotaArgs {
    /// Live sandboxes per tenant [serve default: 1000; --no-auth: 10000].
    #[arg(long, env = "KILN_MAX_SANDBOXES")]
    pub max_sandboxes: Option<u64>,
    /// Live sessions per tenant [serve default: 64; --no-auth: 1024].
    #[arg(long, env = "KILN_MAX_SESSIONS")]
    pub max_sessions: Option<u64>,
    /// Memory a tenant's live sessions really hold together (what they wrote, measured
    /// after their turns; a Linux session counts its cap), e.g. 2GiB or 768MiB [serve
    /// default: 2GiB; --no-auth: half the machine's memory].
    #[arg(long, value_parser = parse_size, env = "KILN_MAX_SESSION_MEMORY")]
    pub max_session_memory: Option<u64>,
    /// Executions a tenant may run at once; more wait in its line (--exec-queue) [serve
    /// default: 16; --no-auth: 64].
    #[arg(long, env = "KILN_MAX_EXECUTIONS")]
    pub max_executions: Option<u64>,
    /// Bytes in all of a tenant's workspaces, e.g. 2GiB [serve default: 2GiB; --no-auth:
    /// half the data folder's free space].
    #[arg(long, value_parser = parse_size, env = "KILN_MAX_WORKSPACE")]
    pub max_workspace: Option<u64>,
    /// A tenant's share of worker CPU when tenants compete, 1 to 100 [serve default: 1].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=100), env = "KILN_CPU_WEIGHT")]
    pub cpu_weight: Option<u32>,
    /// Linux boxes a tenant keeps paused at once (frozen with their memory); over it, its
    /// longest-paused box is hibernated (files kept, processes ended) [serve default: 16;
    /// --no-auth: 128].
    #[arg(long, env = "KILN_MAX_PAUSED_BOXES")]
    pub max_paused_boxes: Option<u64>,
    /// Named volumes a tenant keeps (the bytes their files use count in --max-workspace)
    /// [serve default: 32; --no-auth: 1024].
    #[arg(long, env = "KILN_MAX_VOLUMES")]
    pub max_volumes: Option<u64>,
}

impl QuotaArgs {
    pub fn overrides(&self) -> kiln_runtime::quota::QuotaOverrides {
        kiln_runtime::quota::QuotaOverrides {
            sandboxes: self.max_sandboxes,
            sessions: self.max_sessions,
            session_memory_bytes: self.max_session_memory,
            executions: self.max_executions,
            workspace_bytes: self.max_workspace,
            cpu_weight: self.cpu_weight,
            paused_boxes: self.max_paused_boxes,
            volumes: self.max_volumes,
        }
    }
}

/// A byte size: a number with an optional unit (B, KiB, MiB, GiB, TiB; K, M, G, T and the
/// kB/MB/GB spellings mean the same powers of 1024).
pub fn parse_size(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let number: u64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a size such as 512MiB or 2GiB"))?;
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        other => {
            return Err(format!(
                "unknown size unit {other:?}: use B, KiB, MiB, GiB or TiB"
            ));
        }
    };
    number
        .checked_mul(1u64 << shift)
        .ok_or_else(|| format!("{text:?} is too large"))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    Json,
    Text,
}

#[derive(Debug, Subcommand)]
pub enum KeysCommand {
    /// Create a key; it is printed once and only its hash is kept.
    Create {
        /// A label for people.
        #[arg(long, default_value = "")]
        name: String,
        /// The tenant the key acts for (keys of one tenant see the same sandboxes, but a
        /// workspace only its owner's and those it is shared with). Default: a new tenant
        /// of its own.
        #[arg(long)]
        tenant: Option<String>,
        /// The key's own quotas, where they should differ from the server's.
        #[command(flatten)]
        quotas: QuotaArgs,
        /// Let the key's sandboxes reach hosts beyond the operator's network allowlist
        /// (`--network-allow`) that their own `allowOut` names (on ports 80 and 443, or an
        /// entry's own port). Private networks and this host stay closed unless the operator
        /// lists them. Without it, a sandbox's rules can only narrow the operator's list.
        #[arg(long)]
        network_widen: bool,
        /// An admin key: it may also manage keys and see every tenant's usage and quotas
        /// (`/api/v1/keys`, `/api/v1/tenants`, the console's Keys page). Its sandboxes are
        /// still only its own tenant's.
        #[arg(long)]
        admin: bool,
    },
    /// List keys (ids, names, tenants; never the keys).
    List,
    /// Revoke a key by its id (`key_...`); it stops working at once.
    Revoke { id: String },
}

#[derive(Debug, Args)]
pub struct ExecArgs {
    /// Language: python or javascript (js). Default for `exec`: python.
    #[arg(long, short = 'l', value_parser = parse_language)]
    pub lang: Option<Language>,
    /// The code to run (exec only).
    #[arg(short = 'c', long = "code", visible_short_alias = 'e')]
    pub code: Option<String>,
    /// Wall-clock limit, e.g. 500ms, 10s, 2m. Default 30s.
    #[arg(long, value_parser = parse_duration_ms)]
    pub timeout: Option<u64>,
    /// Memory limit, e.g. 256m, 1g. Default 512m.
    #[arg(long, value_parser = parse_bytes)]
    pub memory: Option<u64>,
    /// An instruction budget in fuel units (about one per WebAssembly instruction; 1 to
    /// 10^12, e.g. 2000000000): the guest stops at the same point on every run when it is
    /// spent, with exit code 121. The deadline (--timeout) still holds. The first use
    /// compiles the runtime with fuel counting, once (Python: about 90 s). Default: none.
    #[arg(long, value_parser = parse_fuel, conflicts_with = "template")]
    pub fuel: Option<u64>,
    /// Bytes of stdout and of stderr kept, e.g. 1m. Default 1m.
    #[arg(long, value_parser = parse_bytes)]
    pub max_output: Option<u64>,
    /// An environment variable for the guest, NAME=VALUE (repeatable).
    #[arg(long = "env", short = 'E')]
    pub env: Vec<String>,
    /// A host directory the guest sees read-write at /workspace (its working directory).
    #[arg(long, short = 'w')]
    pub workspace: Option<PathBuf>,
    /// A host directory for the guest, HOST:GUEST[:rw] (read-only unless :rw; repeatable).
    #[arg(long = "mount")]
    pub mounts: Vec<String>,
    /// Print the whole result as JSON instead of the guest's output.
    #[arg(long)]
    pub json: bool,
    /// Run in a fresh Linux box of this template (`debian`, `python`, `node`, `go`, …)
    /// instead of WebAssembly: a command after `--`, or code with -c (python, javascript
    /// via node, bash). `python-data` runs on WebAssembly, started warm: numpy, pandas,
    /// scipy and matplotlib already imported (its image is built once, at `kiln setup` or
    /// first use).
    #[arg(long)]
    pub template: Option<String>,
    /// Run as the box's root (namespaced: it owns nothing outside the box) instead of its
    /// unprivileged user.
    #[arg(long, requires = "template")]
    pub root: bool,
    /// The box's network: `none`, or `allowlist` (only the names of --network-allow, through
    /// kiln's proxy: enough for pip install and npm install).
    #[arg(long, default_value = "none", requires = "template")]
    pub network: String,
    #[command(flatten)]
    pub linux: LinuxArgs,
    /// After `--`: the command to run in the Linux box (`exec --template`), or the
    /// script's arguments (`run FILE -- ARG…`, Python).
    #[arg(last = true)]
    pub command: Vec<String>,
}

/// Where Linux templates and boxes live.
#[derive(Debug, Clone, Args)]
pub struct LinuxArgs {
    /// A folder of template definitions (*.yaml) besides the shipped ones.
    #[arg(long, env = "KILN_TEMPLATES_DIR")]
    pub templates_dir: Option<PathBuf>,
    /// Runtime state of live boxes (their bundles and mount points).
    #[arg(long, env = "KILN_STATE_DIR", default_value = "/run/kiln")]
    pub state_dir: PathBuf,
    /// The host uid (and gid) a box's root maps to; a box's uids are this and the 65535
    /// above it, owned by no one on the host.
    #[arg(long, env = "KILN_UID_BASE", default_value_t = 100_000)]
    pub uid_base: u32,
    /// The OCI container runtime that starts boxes: `runc`, or gVisor's `runsc` (a user-space
    /// kernel between the box and the host; `KILN_RUNSC_PLATFORM`, default `ptrace`). Also
    /// `--box-runtime`.
    #[arg(
        long,
        alias = "box-runtime",
        env = "KILN_CONTAINER_RUNTIME",
        default_value = "runc"
    )]
    pub container_runtime: PathBuf,
    /// CRIU, which checkpoints a hibernated box's processes so they come back as they were;
    /// `none`: hibernation keeps files only. Default: the one scripts/build-criu puts in
    /// kiln's cache (tools/criu/criu), else `criu` on PATH. Used only where
    /// `criu check` passes.
    #[arg(long, env = "KILN_CRIU")]
    pub criu: Option<PathBuf>,
    /// The Debian mirror templates are built from (default: the host's apt mirror).
    #[arg(long, env = "KILN_DEBIAN_MIRROR")]
    pub debian_mirror: Option<String>,
    /// A host name (or *.domain) boxes with `network: allowlist` may reach on ports 80 and
    /// 443; repeatable. Default: pypi.org, files.pythonhosted.org, registry.npmjs.org. A
    /// name that resolves to a private (RFC 1918, 100.64/10, fc00::/7) or this host's own
    /// address is refused unless that address or its range (`10.20.0.0/16`, `192.168.1.20`)
    /// is listed too; loopback, link-local and multicast never are.
    #[arg(
        long = "network-allow",
        env = "KILN_NETWORK_ALLOW",
        value_delimiter = ','
    )]
    pub network_allow: Vec<String>,
    /// The CA bundle bound over the boxes' own, so boxes trust what the host trusts (a
    /// TLS-inspecting proxy's CA included). Default: the host's (SSL_CERT_FILE, else the
    /// first of /etc/ssl/certs/ca-certificates.crt, /etc/pki/tls/certs/ca-bundle.crt,
    /// /etc/ssl/ca-bundle.pem, /etc/ssl/cert.pem); `none`: the boxes' own.
    #[arg(long, env = "KILN_BOX_CA_BUNDLE")]
    pub box_ca_bundle: Option<PathBuf>,
    /// How long a Linux sandbox's box may run no command, process, terminal or preview
    /// before --box-idle-action (`kiln serve --linux`).
    #[arg(long, env = "KILN_BOX_IDLE", default_value = "15m", value_parser = parse_duration_ms)]
    pub box_idle: u64,
    /// What an idle box gets: `pause` (frozen with everything in it, its processes and the
    /// files outside the workspace included; the next command resumes it) or `stop` (closed:
    /// the workspace stays, the rest is lost). Either way the box goes when its sandbox does.
    /// `hibernate`: as `stop`, and the sandbox shows `hibernated`. A sandbox's own
    /// `lifecycle.onIdle` (or `persistence`) chooses for itself.
    #[arg(long, env = "KILN_BOX_IDLE_ACTION", default_value = "pause",
          value_parser = ["pause", "stop", "hibernate"])]
    pub box_idle_action: String,
    /// How long a box stays paused before it is hibernated: its memory returned, its files
    /// kept, its processes ended (kiln checkpoints none yet); its next command starts a box
    /// again. Unset (the default): a paused box stays paused until its sandbox goes.
    #[arg(long, env = "KILN_BOX_HIBERNATE_AFTER", value_parser = parse_duration_ms)]
    pub box_hibernate_after: Option<u64>,
    /// Warm pool (seed 002): boxes each Linux template keeps started ahead of need, for runs
    /// and sessions outside a sandbox (claimed in well under a millisecond, destroyed after
    /// use, refilled in the background); 0: none. A template's own `pool:` and
    /// --language-pools win over it.
    #[arg(long, env = "KILN_TARGET_POOL_SIZE")]
    pub target_pool_size: Option<usize>,
    /// The most boxes of one template's pool alive at once, ready and in use (default 50).
    #[arg(long, env = "KILN_MAX_VMS")]
    pub max_vms: Option<usize>,
    /// Pool sizes by language or template, `python=10,node=5` (a language sizes the
    /// templates whose first language it is).
    #[arg(long, env = "KILN_LANGUAGE_POOLS", value_delimiter = ',', value_parser = parse_pool_size)]
    pub language_pools: Vec<(String, usize)>,
    /// What a claim on an empty pool does: `wait` (for the next member, up to
    /// --claim-timeout-seconds), `boot_sync` (start one on the request path) or `reject`.
    #[arg(long, env = "KILN_EMPTY_POOL_POLICY", value_parser = ["wait", "boot_sync", "boot-sync", "reject"])]
    pub empty_pool_policy: Option<String>,
    /// How long a claim waits for a pool member before it is refused (default 5).
    #[arg(long, env = "KILN_CLAIM_TIMEOUT_SECONDS")]
    pub claim_timeout_seconds: Option<f64>,
    /// Also run Linux templates as microVMs (`vm-python`, `vm-debian`, …): QEMU's
    /// `microvm` machine in the boxes' jail, KVM where the host has VT-x/AMD-V, else QEMU's
    /// TCG (a software CPU). Needs `qemu-system-x86` and scripts/build-vm. For `kiln exec
    /// --template`: run the template as a microVM.
    #[arg(long, env = "KILN_VM")]
    pub vm: bool,
    /// What runs the microVMs: `qemu` (QEMU's microvm machine: KVM or TCG, the workspace
    /// over 9p) or `firecracker` (KVM with VT-x/AMD-V only; it shares no folder with its VMs,
    /// so its VMs have no workspace: `kiln exec --vm` without `--workspace`).
    #[arg(long, env = "KILN_VMM", default_value = "qemu", value_parser = ["qemu", "firecracker"])]
    pub vmm: String,
    /// Also offer Linux templates under gVisor (`gvisor-python`, …): their boxes run by
    /// runsc, a user-space kernel between the box and the host, whatever `--box-runtime`
    /// says. Needs `runsc` (apt-get install runsc). For `kiln exec --template`: run the box
    /// under gVisor.
    #[arg(long, env = "KILN_GVISOR")]
    pub gvisor: bool,
    /// How many pool members may start at once, across templates: the replenisher's CPU
    /// budget (default: half the cores, at least 1).
    #[arg(long, env = "KILN_POOL_STARTS")]
    pub pool_starts: Option<usize>,
}

fn parse_pool_size(text: &str) -> Result<(String, usize), String> {
    let (name, size) = text
        .split_once('=')
        .ok_or_else(|| format!("{text:?}: expected LANGUAGE=SIZE, as python=10"))?;
    let size: usize = size
        .trim()
        .parse()
        .map_err(|_| format!("{text:?}: the size must be a whole number"))?;
    if size > kiln_core::pool::MAX_POOL_SIZE {
        return Err(format!(
            "{text:?}: at most {} per pool",
            kiln_core::pool::MAX_POOL_SIZE
        ));
    }
    Ok((name.trim().to_string(), size))
}

impl ExecArgs {
    pub fn limits(&self) -> anyhow::Result<Limits> {
        let mut limits = Limits::default();
        if let Some(ms) = self.timeout {
            limits.timeout_ms = ms;
        }
        if let Some(bytes) = self.memory {
            limits.memory_bytes = bytes;
        }
        limits.fuel = self.fuel;
        if let Some(bytes) = self.max_output {
            limits.stdout_bytes = bytes;
            limits.stderr_bytes = bytes;
        }
        limits.validate()?;
        Ok(limits)
    }

    pub fn env_pairs(&self) -> anyhow::Result<Vec<(String, String)>> {
        self.env
            .iter()
            .map(|pair| match pair.split_once('=') {
                Some((name, value)) if !name.is_empty() => Ok((name.to_owned(), value.to_owned())),
                _ => bail!("--env takes NAME=VALUE, got {pair:?}"),
            })
            .collect()
    }

    pub fn mounts(&self) -> anyhow::Result<Vec<Mount>> {
        self.mounts
            .iter()
            .map(|spec| {
                let parts: Vec<&str> = spec.split(':').collect();
                let (host, guest, writable) = match parts.as_slice() {
                    [host, guest] => (host, guest, false),
                    [host, guest, "rw"] => (host, guest, true),
                    [host, guest, "ro"] => (host, guest, false),
                    _ => bail!("--mount takes HOST:GUEST[:rw], got {spec:?}"),
                };
                Ok(Mount {
                    host: PathBuf::from(host),
                    guest: (*guest).to_owned(),
                    writable,
                })
            })
            .collect()
    }
}

#[derive(Debug, Args)]
pub struct BenchArgs {
    /// Iterations of each latency measurement.
    #[arg(long, default_value_t = 200)]
    pub iterations: usize,
    /// Seconds of the throughput measurement.
    #[arg(long, default_value_t = 3.0)]
    pub seconds: f64,
    /// Sessions opened for the idle-memory measurement.
    #[arg(long, default_value_t = 100)]
    pub sessions: usize,
    /// Only the measurements whose names start with these (comma-separated), e.g.
    /// `python_oneshot,cli`.
    #[arg(long)]
    pub only: Option<String>,
    /// Linux boxes held open for the idle-memory measurement (`--only native`).
    #[arg(long, default_value_t = 200)]
    pub boxes: usize,
    #[command(flatten)]
    pub linux: LinuxArgs,
}

/// A fuel budget: digits, optionally with `_` between them (`2_000_000_000`), in
/// 1..=10^12.
fn parse_fuel(text: &str) -> Result<u64, String> {
    let digits = text.replace('_', "");
    let fuel: u64 = digits
        .parse()
        .map_err(|_| format!("{text:?} is not a whole number of fuel units"))?;
    if !(1..=kiln_core::MAX_FUEL).contains(&fuel) {
        return Err(format!("{fuel} is outside 1..=1000000000000"));
    }
    Ok(fuel)
}

fn parse_language(text: &str) -> Result<Language, String> {
    Language::from_name(text)
        .ok_or_else(|| format!("unknown language {text:?}; use python or javascript"))
}

/// `500ms`, `10s`, `2m`, or a bare number of seconds.
pub fn parse_duration_ms(text: &str) -> Result<u64, String> {
    parse_duration_up_to(text, 86_400_000.0, "24h")
}

/// A life: as [`parse_duration_ms`], up to a year (`7d`, `36h`).
pub fn parse_life_ms(text: &str) -> Result<u64, String> {
    parse_duration_up_to(text, 365.0 * 86_400_000.0, "365d")
}

fn parse_duration_up_to(text: &str, max_ms: f64, max_said: &str) -> Result<u64, String> {
    let text = text.trim();
    let (number, unit) = split_unit(text);
    let value: f64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a duration like 500ms, 10s or 2m"))?;
    let factor = match unit {
        "ms" => 1.0,
        "" | "s" => 1_000.0,
        "m" => 60_000.0,
        "h" => 3_600_000.0,
        "d" => 86_400_000.0,
        _ => {
            return Err(format!(
                "{text:?}: unknown unit {unit:?} (use ms, s, m, h or d)"
            ));
        }
    };
    let ms = value * factor;
    if !ms.is_finite() || !(1.0..=max_ms).contains(&ms) {
        return Err(format!("{text:?} is out of range (1ms to {max_said})"));
    }
    Ok(ms as u64)
}

/// `512m`, `1g`, `64k`, or a bare number of bytes.
pub fn parse_bytes(text: &str) -> Result<u64, String> {
    kiln_core::parse_size(text)
}

fn split_unit(text: &str) -> (&str, &str) {
    let at = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    (&text[..at], &text[at..])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_and_sizes_parse() {
        assert_eq!(parse_duration_ms("500ms"), Ok(500));
        assert_eq!(parse_duration_ms("2"), Ok(2000));
        assert_eq!(parse_duration_ms("1.5s"), Ok(1500));
        assert_eq!(parse_duration_ms("2m"), Ok(120_000));
        assert!(parse_duration_ms("0").is_err());
        assert_eq!(parse_duration_ms("10h"), Ok(36_000_000));
        assert!(parse_duration_ms("25h").is_err(), "past 24 hours");
        assert!(parse_duration_ms("10x").is_err());
        assert_eq!(parse_life_ms("7d"), Ok(7 * 86_400_000));
        assert!(parse_life_ms("400d").is_err(), "past a year");
        assert!(parse_duration_ms("abc").is_err());
        assert_eq!(parse_bytes("512m"), Ok(512 << 20));
        assert_eq!(parse_bytes("1G"), Ok(1 << 30));
        assert_eq!(parse_bytes("100"), Ok(100));
        assert!(parse_bytes("1t").is_err());
        assert!(parse_bytes("99999999999999999999g").is_err());
    }
}
