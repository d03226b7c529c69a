//! Workspaces (issue 35, seed 002's "Workspaces & Multi-Agent Workflows"): a named,
//! long-lived Linux sandbox with services. A workspace outlives its box: stopping it stops
//! its services and hibernates its box (files, history and service data stay on the
//! sandbox's volume); starting it brings the services back.
//!
//! Services are real servers from Debian's packages in the `services` template, started by
//! kiln inside the workspace's box as the box's user, each with its data in `~/.services`
//! (the box's writable layer, on the sandbox's volume): `postgres` (PostgreSQL 15),
//! `redis` (Redis 7), `mysql` (MariaDB 10.11), `nginx` (serving the workspace on 8080).
//! Their names (`postgres.workspace.internal`, …) resolve to the box itself. MongoDB is not
//! packaged by Debian: asked for, it is refused with that reason.
//!
//! `run_sql` runs one statement against `postgres` or `mysql` through the template's Python
//! drivers and answers rows as JSON, bounded in rows ([`MAX_ROWS`]) and time.
//!
//! ```text
//! workspaces/<id>.json   its record (tenant, owner, name, sandbox, services)
//! ```

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

use crate::Runtime;
use crate::auth::Caller;
use crate::error::{Result, RuntimeError};
use crate::sandbox::{new_id, now_ms, rfc3339};
use crate::store;

/// The template a workspace runs in unless it names another.
pub const DEFAULT_TEMPLATE: &str = "linux-services";
/// The most rows `run_sql` answers (the rest are counted, not sent).
pub const MAX_ROWS: usize = 1000;
/// `run_sql`'s time limit, default and most.
pub const SQL_TIMEOUT_MS: u64 = 10_000;
pub const MAX_SQL_TIMEOUT_MS: u64 = 60_000;
/// The longest query text.
pub const MAX_QUERY_BYTES: usize = 64 << 10;
/// The most workspaces a tenant keeps.
pub const MAX_WORKSPACES: usize = 64;
/// The most `run_sql` calls of one workspace waiting for their turn (one runs at a time);
/// more are refused with `BUSY` at once.
pub const MAX_SQL_WAITING: usize = 256;

/// A service a workspace may run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum ServiceKind {
    Postgres,
    Redis,
    Mysql,
    Nginx,
}

impl ServiceKind {
    pub const ALL: [ServiceKind; 4] = [
        ServiceKind::Postgres,
        ServiceKind::Redis,
        ServiceKind::Mysql,
        ServiceKind::Nginx,
    ];

    pub fn name(self) -> &'static str {
        match self {
            ServiceKind::Postgres => "postgres",
            ServiceKind::Redis => "redis",
            ServiceKind::Mysql => "mysql",
            ServiceKind::Nginx => "nginx",
        }
    }

    /// The service named `name`, or why there is none.
    pub fn parse(name: &str) -> Result<ServiceKind> {
        let wanted = name.trim().to_ascii_lowercase();
        match wanted.as_str() {
            "postgres" | "postgresql" => Ok(ServiceKind::Postgres),
            "redis" => Ok(ServiceKind::Redis),
            "mysql" | "mariadb" => Ok(ServiceKind::Mysql),
            "nginx" => Ok(ServiceKind::Nginx),
            "mongodb" | "mongo" => Err(RuntimeError::Unsupported {
                message: "mongodb: Debian does not package MongoDB (its licence), so kiln's services template has none; postgres (with JSONB) or redis may serve".into(),
            }),
            _ => Err(RuntimeError::InvalidOption {
                message: format!(
                    "{name:?} is not a service: one of postgres, redis, mysql, nginx"
                ),
            }),
        }
    }

    pub fn port(self) -> u16 {
        match self {
            ServiceKind::Postgres => 5432,
            ServiceKind::Redis => 6379,
            ServiceKind::Mysql => 3306,
            ServiceKind::Nginx => 8080,
        }
    }

    /// The host name it answers on inside the box.
    pub fn host(self) -> String {
        format!("{}.workspace.internal", self.name())
    }

    pub fn connection_string(self) -> String {
        let host = self.host();
        match self {
            ServiceKind::Postgres => format!("postgresql://postgres@{host}:5432/postgres"),
            ServiceKind::Redis => format!("redis://{host}:6379/0"),
            ServiceKind::Mysql => format!("mysql://root@{host}:3306/mysql"),
            ServiceKind::Nginx => format!("http://{host}:8080/"),
        }
    }

    /// The script that starts it (made on first start) as the box's user; it exits 0 once
    /// the service answers, else prints its log's tail and fails.
    fn start_script(self) -> &'static str {
        match self {
            ServiceKind::Postgres => {
                r#"set -u; d=~/.services/postgres; mkdir -p ~/.services
if [ ! -s "$d/PG_VERSION" ]; then
  /usr/lib/postgresql/15/bin/initdb -D "$d" -U postgres --auth=trust -E UTF8 >~/.services/postgres-init.log 2>&1 || { tail -n 20 ~/.services/postgres-init.log; exit 1; }
fi
/usr/lib/postgresql/15/bin/pg_ctl -D "$d" status >/dev/null 2>&1 && exit 0
/usr/lib/postgresql/15/bin/pg_ctl -D "$d" -l ~/.services/postgres.log -o "-c listen_addresses=127.0.0.1 -k /tmp" -w -t 30 start >/dev/null 2>&1 || { tail -n 20 ~/.services/postgres.log; exit 1; }"#
            }
            ServiceKind::Redis => {
                r#"set -u; mkdir -p ~/.services/redis
redis-cli -h 127.0.0.1 ping >/dev/null 2>&1 && exit 0
redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --dir ~/.services/redis --logfile ~/.services/redis.log --pidfile ~/.services/redis.pid || { tail -n 20 ~/.services/redis.log; exit 1; }
for i in $(seq 100); do redis-cli -h 127.0.0.1 ping >/dev/null 2>&1 && exit 0; sleep 0.1; done
tail -n 20 ~/.services/redis.log; exit 1"#
            }
            ServiceKind::Mysql => {
                r#"set -u; d=~/.services/mysql; mkdir -p ~/.services
if [ ! -d "$d/mysql" ]; then
  mariadb-install-db --datadir="$d" --auth-root-authentication-method=normal --skip-test-db >~/.services/mysql-init.log 2>&1 || { tail -n 20 ~/.services/mysql-init.log; exit 1; }
fi
mariadb-admin -h 127.0.0.1 -uroot ping >/dev/null 2>&1 && exit 0
(setsid mariadbd --datadir="$d" --socket=/tmp/mysql.sock --pid-file="$HOME/.services/mysql.pid" --bind-address=127.0.0.1 --port=3306 >>~/.services/mysql.log 2>&1 &)
for i in $(seq 300); do mariadb-admin -h 127.0.0.1 -uroot ping >/dev/null 2>&1 && exit 0; sleep 0.1; done
tail -n 20 ~/.services/mysql.log; exit 1"#
            }
            ServiceKind::Nginx => {
                r#"set -u; d=~/.services/nginx; mkdir -p "$d/tmp"
cat > "$d/nginx.conf.new" <<CONF
daemon on; pid $d/nginx.pid; error_log $d/error.log; worker_processes 1;
events { worker_connections 256; }
http { include /etc/nginx/mime.types; access_log $d/access.log;
  client_body_temp_path $d/tmp; proxy_temp_path $d/tmp; fastcgi_temp_path $d/tmp;
  uwsgi_temp_path $d/tmp; scgi_temp_path $d/tmp;
  server { listen 127.0.0.1:8080; root $PWD/${KILN_NGINX_ROOT:-}; index index.html; } }
CONF
running() { [ -s "$d/nginx.pid" ] && kill -0 "$(cat "$d/nginx.pid")" 2>/dev/null; }
if running; then
  if cmp -s "$d/nginx.conf.new" "$d/nginx.conf"; then rm -f "$d/nginx.conf.new"; exit 0; fi
  # Another folder to serve: stopped and started again (a reload answers from the old
  # workers for a while).
  kill -QUIT "$(cat "$d/nginx.pid")"
  for i in $(seq 100); do running || break; sleep 0.05; done
fi
mv "$d/nginx.conf.new" "$d/nginx.conf"
nginx -c "$d/nginx.conf" -e "$d/error.log" 2>>"$d/error.log" || { tail -n 20 "$d/error.log"; exit 1; }
for i in $(seq 100); do curl -s -o /dev/null http://127.0.0.1:8080/ && exit 0; sleep 0.05; done
tail -n 20 "$d/error.log"; exit 1"#
            }
        }
    }

    /// The script that stops it (quietly, whether it runs or not).
    fn stop_script(self) -> &'static str {
        match self {
            ServiceKind::Postgres => {
                "/usr/lib/postgresql/15/bin/pg_ctl -D ~/.services/postgres -m fast -w stop >/dev/null 2>&1; true"
            }
            ServiceKind::Redis => "redis-cli -h 127.0.0.1 shutdown save >/dev/null 2>&1; true",
            ServiceKind::Mysql => {
                "mariadb-admin -h 127.0.0.1 -uroot shutdown >/dev/null 2>&1; true"
            }
            ServiceKind::Nginx => {
                "[ -s ~/.services/nginx/nginx.pid ] && kill -QUIT \"$(cat ~/.services/nginx/nginx.pid)\" 2>/dev/null; true"
            }
        }
    }
}

/// A workspace's service, as a client connects to it (from inside the box).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Service {
    #[serde(rename = "type")]
    pub kind: ServiceKind,
    pub host: String,
    pub port: u16,
    pub connection_string: String,
}

impl Service {
    pub fn of(kind: ServiceKind) -> Service {
        Service {
            kind,
            host: kind.host(),
            port: kind.port(),
            connection_string: kind.connection_string(),
        }
    }
}

/// A workspace.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct WorkspaceInfo {
    /// `ws_…`.
    pub id: String,
    pub name: String,
    /// The key that made it.
    pub owner: String,
    pub template: String,
    /// The sandbox it runs in: its files, history, processes, terminals and previews are
    /// the sandbox's (`/api/v1/sandboxes/{sandboxId}/…`).
    pub sandbox_id: String,
    pub services: Vec<Service>,
    /// Its previews are open to anyone (no key, no link).
    #[serde(default)]
    pub public_preview: bool,
    /// What its preview shows, once enabled ([`enable_preview`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preview: Option<Preview>,
    /// `running` or `stopped`.
    pub state: String,
    pub created_at: String,
    /// Other keys of the tenant it is shared with. Nobody else of the tenant sees it.
    #[serde(default)]
    pub collaborators: Vec<Collaborator>,
}

/// A key a workspace is shared with, and how far.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Collaborator {
    /// The key's public id (`key_…`, as `kiln keys list` shows it).
    pub key_id: String,
    pub access: Access,
}

/// How far a collaborator may go.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Access {
    /// See it: its record, files, history, workflows; `run_sql` in a read-only transaction.
    Read,
    /// Work in it as the owner does (its sandbox too), but not delete it or share it.
    Write,
}

/// What an operation on a workspace needs of its caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Need {
    Read,
    Write,
    /// The owner's alone: delete it, share it.
    Own,
}

impl WorkspaceInfo {
    /// Whether key `key_id` may do what `need` asks.
    pub fn allows(&self, key_id: &str, need: Need) -> bool {
        if self.owner == key_id {
            return true;
        }
        match self.collaborators.iter().find(|c| c.key_id == key_id) {
            None => false,
            Some(c) => match need {
                Need::Own => false,
                Need::Write => c.access == Access::Write,
                Need::Read => true,
            },
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Stored {
    #[serde(flatten)]
    info: WorkspaceInfo,
    tenant: String,
}

/// The workspaces of a server.
#[derive(Debug)]
pub struct Workspaces {
    root: PathBuf,
    all: Mutex<HashMap<String, Stored>>,
    /// Each workspace's line of `run_sql` calls: one runs, the rest wait their turn.
    sql_lines: Mutex<HashMap<String, Arc<SqlLine>>>,
}

/// One workspace's `run_sql` calls: a turn at a time, a bounded number waiting.
#[derive(Debug)]
struct SqlLine {
    turn: Arc<tokio::sync::Semaphore>,
    waiting: std::sync::atomic::AtomicUsize,
}

impl Workspaces {
    pub fn open(data_dir: &Path) -> Workspaces {
        let root = data_dir.join("workspaces");
        let mut all = HashMap::new();
        for entry in std::fs::read_dir(&root).into_iter().flatten().flatten() {
            let path = entry.path();
            if path.extension().is_some_and(|e| e == "json") {
                match store::read_json::<Stored>(&path) {
                    Ok(stored) => {
                        all.insert(stored.info.id.clone(), stored);
                    }
                    Err(e) => tracing::error!(
                        "workspace {}: unreadable record ({e}); left as it is",
                        path.display()
                    ),
                }
            }
        }
        Workspaces {
            root,
            all: Mutex::new(all),
            sql_lines: Mutex::default(),
        }
    }

    /// Waits for workspace `id`'s turn to run SQL (first come, first served), or refuses at
    /// once when [`MAX_SQL_WAITING`] calls wait already.
    async fn sql_turn(&self, id: &str) -> Result<tokio::sync::OwnedSemaphorePermit> {
        use std::sync::atomic::Ordering;
        let line = self
            .sql_lines
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(id.to_owned())
            .or_insert_with(|| {
                Arc::new(SqlLine {
                    turn: Arc::new(tokio::sync::Semaphore::new(1)),
                    waiting: Default::default(),
                })
            })
            .clone();
        if line.waiting.fetch_add(1, Ordering::SeqCst) >= MAX_SQL_WAITING {
            line.waiting.fetch_sub(1, Ordering::SeqCst);
            return Err(RuntimeError::Saturated {
                message: format!(
                    "{MAX_SQL_WAITING} statements already wait for this workspace's database; retry when some finish"
                ),
            });
        }
        let permit = line.turn.clone().acquire_owned().await;
        line.waiting.fetch_sub(1, Ordering::SeqCst);
        permit.map_err(|_| RuntimeError::internal("the workspace's SQL line closed"))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Stored>> {
        self.all.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn save(&self, stored: &Stored) -> Result<()> {
        std::fs::create_dir_all(&self.root)
            .and_then(|()| {
                store::write_json(&self.root.join(format!("{}.json", stored.info.id)), stored)
            })
            .map_err(|e| RuntimeError::internal(format!("recording the workspace: {e}")))?;
        self.lock().insert(stored.info.id.clone(), stored.clone());
        Ok(())
    }

    /// `tenant`'s workspaces, oldest first.
    pub fn list(&self, tenant: &str) -> Vec<WorkspaceInfo> {
        let mut own: Vec<WorkspaceInfo> = self
            .lock()
            .values()
            .filter(|s| s.tenant == tenant)
            .map(|s| s.info.clone())
            .collect();
        own.sort_by(|a, b| a.created_at.cmp(&b.created_at).then(a.id.cmp(&b.id)));
        own
    }

    /// `caller`'s workspace by id or name, when it may do what `need` asks (else, as for a
    /// workspace that is not there, [`RuntimeError::WorkspaceNotFound`]).
    pub fn get_as(&self, caller: &Caller, which: &str, need: Need) -> Result<WorkspaceInfo> {
        let ws = self.get(&caller.tenant, which)?;
        if ws.allows(&caller.key_id, need) {
            Ok(ws)
        } else {
            Err(RuntimeError::WorkspaceNotFound {
                workspace: which.to_owned(),
            })
        }
    }

    /// The workspaces `caller` may see (its own and those shared with it), oldest first.
    pub fn list_for(&self, caller: &Caller) -> Vec<WorkspaceInfo> {
        let mut own = self.list(&caller.tenant);
        own.retain(|w| w.allows(&caller.key_id, Need::Read));
        own
    }

    /// Whether `caller` may use sandbox `id` through the sandbox routes: a sandbox that is
    /// no workspace's, or one of a workspace it owns or may write.
    pub fn may_use_sandbox(&self, caller: &Caller, id: &str) -> bool {
        self.lock()
            .values()
            .find(|s| s.info.sandbox_id == id)
            .is_none_or(|s| s.tenant != caller.tenant || s.info.allows(&caller.key_id, Need::Write))
    }

    /// Shares workspace `which` of `caller`'s (the owner's) with `collaborators` (replacing
    /// those it had). The keys are the caller's to check (they are the server's).
    pub fn share(
        &self,
        caller: &Caller,
        which: &str,
        collaborators: Vec<Collaborator>,
    ) -> Result<WorkspaceInfo> {
        let ws = self.get_as(caller, which, Need::Own)?;
        self.update(&caller.tenant, &ws.id, |w| w.collaborators = collaborators)
    }

    /// `tenant`'s workspace by id or name.
    pub fn get(&self, tenant: &str, which: &str) -> Result<WorkspaceInfo> {
        self.lock()
            .values()
            .find(|s| s.tenant == tenant && (s.info.id == which || s.info.name == which))
            .map(|s| s.info.clone())
            .ok_or_else(|| RuntimeError::WorkspaceNotFound {
                workspace: which.to_owned(),
            })
    }

    fn update(
        &self,
        tenant: &str,
        id: &str,
        change: impl FnOnce(&mut WorkspaceInfo),
    ) -> Result<WorkspaceInfo> {
        let mut stored = self
            .lock()
            .get(id)
            .filter(|s| s.tenant == tenant)
            .cloned()
            .ok_or_else(|| RuntimeError::WorkspaceNotFound {
                workspace: id.to_owned(),
            })?;
        change(&mut stored.info);
        self.save(&stored)?;
        Ok(stored.info)
    }

    fn forget(&self, id: &str) {
        self.lock().remove(id);
        self.sql_lines
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(id);
        let _ = std::fs::remove_file(self.root.join(format!("{id}.json")));
    }
}

/// What a new workspace is made of.
#[derive(Debug, Clone, Default, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct NewWorkspace {
    /// 1..=64 of `A-Z a-z 0-9 _ . -`, unique within the tenant.
    pub name: String,
    /// A Linux template (default `linux-services`).
    pub template: Option<String>,
    /// Services to start with it: `postgres`, `redis`, `mysql`, `nginx`.
    #[serde(default)]
    pub services: Vec<String>,
    /// Its previews open to anyone, with no key or link (seed 002's `public_preview`).
    #[serde(default)]
    pub public_preview: bool,
}

fn services_of(names: &[String]) -> Result<Vec<ServiceKind>> {
    let mut kinds = Vec::new();
    for name in names {
        let kind = ServiceKind::parse(name)?;
        if !kinds.contains(&kind) {
            kinds.push(kind);
        }
    }
    Ok(kinds)
}

/// Makes a workspace of `caller`'s: a sandbox of its template with no fixed life, and its
/// services started.
pub async fn create(
    rt: &Arc<Runtime>,
    caller: &Caller,
    new: NewWorkspace,
) -> Result<WorkspaceInfo> {
    if !crate::volumes::name_ok(&new.name) {
        return Err(RuntimeError::InvalidOption {
            message: format!(
                "{:?} is not a workspace name: 1..=64 of A-Z a-z 0-9 _ . -",
                new.name
            ),
        });
    }
    let kinds = services_of(&new.services)?;
    {
        let own = rt.registry.workspaces.list(&caller.tenant);
        if own.iter().any(|w| w.name == new.name) {
            return Err(RuntimeError::InvalidOption {
                message: format!("a workspace named {:?} exists", new.name),
            });
        }
        if own.len() >= MAX_WORKSPACES {
            return Err(crate::quota::exceeded(
                "workspaces",
                MAX_WORKSPACES as u64,
                own.len() as u64,
                "workspaces",
            ));
        }
    }
    let template = new.template.unwrap_or_else(|| DEFAULT_TEMPLATE.to_string());
    let catalogue = rt.catalogue();
    let Some(entry) = catalogue.get(&template) else {
        return Err(RuntimeError::Unsupported {
            message: format!(
                "no template {template:?} here: a workspace runs in a Linux template (start kiln with --linux, and build it: kiln setup --template services)"
            ),
        });
    };
    if !entry.capabilities.processes {
        return Err(RuntimeError::Unsupported {
            message: format!(
                "{template} is not a Linux template: a workspace needs a box for its services"
            ),
        });
    }
    let image =
        crate::sandbox::SandboxSpec::named_image(catalogue, None, Some(&template), "python")?;
    let spec = crate::sandbox::SandboxSpec::resolve(catalogue, &image, None, None)?
        .with_public_previews(catalogue, new.public_preview)?;
    let sandbox = crate::exec::create_sandbox(rt, caller, spec).await?;
    let stored = Stored {
        info: WorkspaceInfo {
            id: new_id("ws_"),
            name: new.name,
            owner: caller.key_id.clone(),
            template,
            sandbox_id: sandbox.id.clone(),
            services: Vec::new(),
            public_preview: new.public_preview,
            preview: None,
            state: "running".into(),
            created_at: rfc3339(now_ms()),
            collaborators: Vec::new(),
        },
        tenant: caller.tenant.clone(),
    };
    let id = stored.info.id.clone();
    if let Err(e) = rt.registry.workspaces.save(&stored) {
        let _ = rt.delete_sandbox(caller, &sandbox.id).await;
        return Err(e);
    }
    for kind in kinds {
        if let Err(e) = add_service(rt, caller, &id, kind).await {
            let _ = delete(rt, caller, &id).await;
            return Err(e);
        }
    }
    rt.registry.workspaces.get(&caller.tenant, &id)
}

/// Runs `script` with bash in the workspace's box as its user: stdout and stderr, or why not.
async fn run_script(
    rt: &Arc<Runtime>,
    caller: &Caller,
    sandbox: &str,
    argv: Vec<String>,
    timeout_ms: u64,
    env: std::collections::BTreeMap<String, String>,
) -> Result<crate::exec::RunOutcome> {
    let spec = crate::exec::prepare(
        rt,
        caller,
        sandbox,
        crate::exec::CodeExec {
            command: Some(argv),
            timeout_ms: Some(timeout_ms),
            env,
            ..Default::default()
        },
    )?;
    crate::exec::run(rt, caller, sandbox, spec, None).await
}

fn said(outcome: &crate::exec::RunOutcome) -> String {
    let out = String::from_utf8_lossy(&outcome.result.stdout);
    let err = String::from_utf8_lossy(&outcome.result.stderr);
    format!("{}{}", out.trim(), err.trim())
        .chars()
        .take(4000)
        .collect()
}

/// Starts service `kind` in workspace `which` (kept started with it from then on): how a
/// client reaches it. A service that does not start says why (its log's tail).
pub async fn add_service(
    rt: &Arc<Runtime>,
    caller: &Caller,
    which: &str,
    kind: ServiceKind,
) -> Result<Service> {
    let ws = rt.registry.workspaces.get_as(caller, which, Need::Write)?;
    start_one(rt, caller, &ws, kind).await?;
    rt.registry.workspaces.update(&caller.tenant, &ws.id, |w| {
        if !w.services.iter().any(|s| s.kind == kind) {
            w.services.push(Service::of(kind));
        }
    })?;
    rt.events.record(
        &ws.sandbox_id,
        "service",
        &format!("{} started", kind.name()),
    );
    Ok(Service::of(kind))
}

async fn start_one(
    rt: &Arc<Runtime>,
    caller: &Caller,
    ws: &WorkspaceInfo,
    kind: ServiceKind,
) -> Result<()> {
    let mut env = std::collections::BTreeMap::new();
    if kind == ServiceKind::Nginx
        && let Some(preview) = ws
            .preview
            .as_ref()
            .filter(|p| p.kind == PreviewKind::Static)
    {
        env.insert("KILN_NGINX_ROOT".to_string(), preview.root_path.clone());
    }
    let outcome = run_script(
        rt,
        caller,
        &ws.sandbox_id,
        vec!["bash".into(), "-c".into(), kind.start_script().into()],
        90_000,
        env,
    )
    .await?;
    if outcome.result.success() {
        return Ok(());
    }
    Err(RuntimeError::Unsupported {
        message: format!(
            "the {} service did not start ({}): {}",
            kind.name(),
            outcome.status(),
            said(&outcome)
        ),
    })
}

/// What a workspace's preview shows (seed 002's `PreviewConfig`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum PreviewKind {
    /// The workspace's files (a folder of it), served by its nginx on 8080.
    Static,
    /// A server the workspace runs, on a port of its own.
    Proxy,
}

/// A workspace's preview: what it shows and on which port of the box.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Preview {
    #[serde(rename = "type")]
    pub kind: PreviewKind,
    pub port: u16,
    /// The folder of the workspace served (`static`), relative to it; empty: all of it.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub root_path: String,
}

/// Enables workspace `which`'s preview: `static` serves `root_path` (a folder of the
/// workspace, default all of it) with its nginx (added as a service if it has none) on
/// 8080; `proxy` shows what its own server answers on `port`. Answers the workspace; the
/// caller makes the link (`/preview/{sandboxId}/{port}/`).
pub async fn enable_preview(
    rt: &Arc<Runtime>,
    caller: &Caller,
    which: &str,
    kind: &str,
    root_path: Option<&str>,
    port: Option<u16>,
) -> Result<WorkspaceInfo> {
    let ws = rt.registry.workspaces.get_as(caller, which, Need::Write)?;
    let preview = match kind {
        "static" => {
            if port.is_some_and(|p| p != ServiceKind::Nginx.port()) {
                return Err(RuntimeError::InvalidOption {
                    message: "a static preview is served on 8080 by the workspace's nginx; give a port with a proxy preview".into(),
                });
            }
            let root = root_path.unwrap_or("/").trim_matches('/');
            // It goes into nginx's configuration: plain path characters only.
            if !root
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | '/'))
            {
                return Err(RuntimeError::InvalidOption {
                    message: format!(
                        "{root:?} is not a folder a preview serves: letters, digits and . _ - / only"
                    ),
                });
            }
            let root_path = if root.is_empty() {
                String::new()
            } else {
                crate::sandbox::workspace_path(root)?.to_string()
            };
            Preview {
                kind: PreviewKind::Static,
                port: ServiceKind::Nginx.port(),
                root_path,
            }
        }
        "proxy" => {
            let Some(port) = port.filter(|p| *p > 0) else {
                return Err(RuntimeError::InvalidOption {
                    message: "a proxy preview needs the port the workspace's server listens on (1..=65535)".into(),
                });
            };
            Preview {
                kind: PreviewKind::Proxy,
                port,
                root_path: String::new(),
            }
        }
        other => {
            return Err(RuntimeError::InvalidOption {
                message: format!("{other:?} is not a preview type: static or proxy"),
            });
        }
    };
    let ws = rt.registry.workspaces.update(&caller.tenant, &ws.id, |w| {
        w.preview = Some(preview.clone())
    })?;
    if preview.kind == PreviewKind::Static {
        add_service(rt, caller, &ws.id, ServiceKind::Nginx).await?;
    }
    rt.registry.workspaces.get(&caller.tenant, &ws.id)
}

/// Starts workspace `which`: its box (restored if hibernated) and every service of it.
pub async fn start(rt: &Arc<Runtime>, caller: &Caller, which: &str) -> Result<WorkspaceInfo> {
    let ws = rt.registry.workspaces.get_as(caller, which, Need::Write)?;
    for service in &ws.services {
        start_one(rt, caller, &ws, service.kind).await?;
    }
    rt.registry
        .workspaces
        .update(&caller.tenant, &ws.id, |w| w.state = "running".into())
}

/// Stops workspace `which`: its services shut down cleanly (their data written), then its
/// box is hibernated (its memory back to the host; files and history kept).
pub async fn stop(rt: &Arc<Runtime>, caller: &Caller, which: &str) -> Result<WorkspaceInfo> {
    let ws = rt.registry.workspaces.get_as(caller, which, Need::Write)?;
    let script: Vec<&str> = ws.services.iter().map(|s| s.kind.stop_script()).collect();
    if !script.is_empty() {
        run_script(
            rt,
            caller,
            &ws.sandbox_id,
            vec!["bash".into(), "-c".into(), script.join("\n")],
            60_000,
            Default::default(),
        )
        .await?;
    }
    let sandbox = rt.registry.get(&caller.tenant, &ws.sandbox_id)?.meta;
    if let Some(host) = rt.process_host(&sandbox) {
        host.hibernate(&sandbox.workspace(), "its workspace was stopped")
            .await
            .map_err(|e| RuntimeError::internal(format!("stopping the box: {}", e.message)))?;
    }
    rt.registry
        .workspaces
        .update(&caller.tenant, &ws.id, |w| w.state = "stopped".into())
}

/// Deletes workspace `which` and its sandbox (its files, history and service data).
pub async fn delete(rt: &Arc<Runtime>, caller: &Caller, which: &str) -> Result<()> {
    let ws = rt.registry.workspaces.get_as(caller, which, Need::Own)?;
    match rt.delete_sandbox(caller, &ws.sandbox_id).await {
        Ok(()) | Err(RuntimeError::SandboxNotFound { .. }) => {}
        Err(e) => return Err(e),
    }
    rt.registry.workspaces.forget(&ws.id);
    Ok(())
}

/// The rows of one SQL statement.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct SqlResult {
    /// The result's columns (none for a statement without rows).
    #[serde(default)]
    pub columns: Vec<String>,
    /// Each row as an object of column → value (numbers, text, booleans, null; other
    /// types as text).
    #[serde(default)]
    #[schema(value_type = Vec<Object>)]
    pub rows: Vec<serde_json::Map<String, serde_json::Value>>,
    /// Rows affected (or -1 where the driver does not say).
    pub rowcount: i64,
    /// More rows than [`MAX_ROWS`] were there; the rest were not sent.
    #[serde(default)]
    pub truncated: bool,
}

/// The driver script: one statement, its rows as JSON on one line, or `{"error": …}`.
const SQL_PY: &str = r#"
import json, sys
kind, query, limit, timeout_ms = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
# "ro": a read collaborator's statement, run as a role the database lets read only.
read_only = sys.argv[5] == "ro"
def value(v):
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (bytes, bytearray, memoryview)):
        return bytes(v).hex()
    return str(v)
try:
    if kind == "postgres":
        import psycopg2
        conn = psycopg2.connect(host="127.0.0.1", user="postgres", dbname="postgres",
                                options="-c statement_timeout=%d" % timeout_ms, connect_timeout=10)
        conn.autocommit = True
        if read_only:
            conn.cursor().execute("DO $$ BEGIN IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'kiln_reader') THEN CREATE ROLE kiln_reader LOGIN; END IF; END $$; GRANT pg_read_all_data TO kiln_reader")
            conn.close()
            conn = psycopg2.connect(host="127.0.0.1", user="kiln_reader", dbname="postgres",
                                    options="-c statement_timeout=%d -c default_transaction_read_only=on" % timeout_ms, connect_timeout=10)
            conn.autocommit = True
    else:
        import pymysql
        conn = pymysql.connect(host="127.0.0.1", user="root", autocommit=True, connect_timeout=10)
        if read_only:
            conn.cursor().execute("CREATE USER IF NOT EXISTS 'kiln_reader'@'%'")
            conn.cursor().execute("GRANT SELECT ON *.* TO 'kiln_reader'@'%'")
            conn.close()
            conn = pymysql.connect(host="127.0.0.1", user="kiln_reader", autocommit=True, connect_timeout=10)
        conn.cursor().execute("SET SESSION max_statement_time = %f" % (timeout_ms / 1000.0))
except Exception as e:
    print(json.dumps({"error": str(e).strip(), "unreachable": True}))
    sys.exit(0)
try:
    cur = conn.cursor()
    cur.execute(query)
    out = {"rowcount": cur.rowcount if cur.rowcount is not None else -1, "columns": [], "rows": []}
    if cur.description:
        cols = [d[0] for d in cur.description]
        rows = cur.fetchmany(limit + 1)
        out["columns"] = cols
        out["rows"] = [dict(zip(cols, map(value, r))) for r in rows[:limit]]
        out["truncated"] = len(rows) > limit
    print(json.dumps(out))
except Exception as e:
    print(json.dumps({"error": str(e).strip()}))
"#;

/// Runs one SQL statement against workspace `which`'s `service` (postgres or mysql, which
/// must be one of its services), bounded by `timeout_ms` (default [`SQL_TIMEOUT_MS`], at
/// most [`MAX_SQL_TIMEOUT_MS`]) and [`MAX_ROWS`].
pub async fn run_sql(
    rt: &Arc<Runtime>,
    caller: &Caller,
    which: &str,
    service: Option<&str>,
    query: &str,
    timeout_ms: Option<u64>,
) -> Result<SqlResult> {
    let ws = rt.registry.workspaces.get_as(caller, which, Need::Read)?;
    let kind = match service {
        Some(name) => ServiceKind::parse(name)?,
        None => ws
            .services
            .iter()
            .map(|s| s.kind)
            .find(|k| matches!(k, ServiceKind::Postgres | ServiceKind::Mysql))
            .unwrap_or(ServiceKind::Postgres),
    };
    if !matches!(kind, ServiceKind::Postgres | ServiceKind::Mysql) {
        return Err(RuntimeError::InvalidOption {
            message: format!(
                "{} speaks no SQL: run_sql is for postgres and mysql",
                kind.name()
            ),
        });
    }
    if !ws.services.iter().any(|s| s.kind == kind) {
        return Err(RuntimeError::InvalidOption {
            message: format!(
                "workspace {} has no {} service: add it first (POST …/services {{\"type\": \"{}\"}})",
                ws.name,
                kind.name(),
                kind.name()
            ),
        });
    }
    if query.trim().is_empty() || query.len() > MAX_QUERY_BYTES || query.contains('\0') {
        return Err(RuntimeError::InvalidOption {
            message: format!("a query is 1..={MAX_QUERY_BYTES} bytes of text"),
        });
    }
    let timeout_ms = timeout_ms.unwrap_or(SQL_TIMEOUT_MS);
    if !(1..=MAX_SQL_TIMEOUT_MS).contains(&timeout_ms) {
        return Err(RuntimeError::InvalidOption {
            message: format!("timeoutMs must be 1..={MAX_SQL_TIMEOUT_MS}"),
        });
    }
    let _turn = rt.registry.workspaces.sql_turn(&ws.id).await?;
    // A stopped workspace's service comes back first (its box is restored on the way);
    // a running one's is started again only when it does not answer.
    let read_only = !ws.allows(&caller.key_id, Need::Write);
    if ws.state == "stopped" {
        if read_only {
            return Err(RuntimeError::InvalidOption {
                message: format!(
                    "workspace {} is stopped; its owner or a writer starts it",
                    ws.name
                ),
            });
        }
        start(rt, caller, &ws.id).await?;
    }
    let mut value = sql_once(rt, caller, &ws, kind, query, timeout_ms, read_only).await?;
    if value.get("unreachable").is_some() {
        start_one(rt, caller, &ws, kind).await?;
        value = sql_once(rt, caller, &ws, kind, query, timeout_ms, read_only).await?;
    }
    if let Some(error) = value.get("error").and_then(|e| e.as_str()) {
        return Err(RuntimeError::InvalidOption {
            message: format!("{}: {error}", kind.name()),
        });
    }
    serde_json::from_value(value)
        .map_err(|e| RuntimeError::internal(format!("run_sql's answer: {e}")))
}

/// Runs the driver once: its one-line answer (rows, or `{"error": …}`). Another command of
/// the sandbox's that holds it (a user's exec) is waited for, up to the statement's time.
async fn sql_once(
    rt: &Arc<Runtime>,
    caller: &Caller,
    ws: &WorkspaceInfo,
    kind: ServiceKind,
    query: &str,
    timeout_ms: u64,
    read_only: bool,
) -> Result<serde_json::Value> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_millis(timeout_ms);
    let outcome = loop {
        let ran = run_script(
            rt,
            caller,
            &ws.sandbox_id,
            vec![
                "python3".into(),
                "-c".into(),
                SQL_PY.into(),
                kind.name().into(),
                query.into(),
                MAX_ROWS.to_string(),
                timeout_ms.to_string(),
                if read_only { "ro" } else { "rw" }.into(),
            ],
            timeout_ms + 15_000,
            Default::default(),
        )
        .await;
        match ran {
            Err(RuntimeError::SandboxBusy { .. }) if std::time::Instant::now() < deadline => {
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
            other => break other?,
        }
    };
    let text = String::from_utf8_lossy(&outcome.result.stdout);
    let line = text
        .lines()
        .rev()
        .find(|l| l.starts_with('{'))
        .unwrap_or("");
    serde_json::from_str(line).map_err(|_| {
        RuntimeError::internal(format!(
            "run_sql got no answer from the driver ({}): {}",
            outcome.status(),
            said(&outcome)
        ))
    })
}
