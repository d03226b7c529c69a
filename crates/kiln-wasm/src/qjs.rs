//! The host's side of kiln's QuickJS: calls into the reactor through the exports
//! `qjs_exports` adds, kiln's JavaScript (`js/prelude.js`) as bytecode, and Node's event
//! loop.
//!
//! A one-shot starts QuickJS (`qjs_init_argv` with no code), runs the prelude's bytecode,
//! compiles and starts the program as a module, then runs the event loop from the host:
//! promise jobs until none is left, QuickJS's check for unhandled rejections, the next
//! timer, and again. QuickJS's own loop (`js_std_await`) polls its timers after every job,
//! so a due timer would run before the jobs queued ahead of it; Node runs them all first.

use wasmtime::{Instance, Store, TypedFunc};

use crate::guest::GuestState;
use crate::qjs_exports;

/// A `JSValue` of this QuickJS build: NaN-boxed, its tag in the high 32 bits.
type JsValue = i64;
const JS_TAG_MODULE: i64 = -3;
const JS_TAG_INT: i64 = 0;
const JS_TAG_EXCEPTION: i64 = 6;
const JS_PROMISE_PENDING: i32 = 0;
const JS_PROMISE_REJECTED: i32 = 2;
/// `JS_Eval`'s types: a classic script (its `var`s become globals) or a module.
const SCRIPT: i32 = 0;
const MODULE: i32 = 1;
const JS_EVAL_FLAG_COMPILE_ONLY: i32 = 1 << 5;
const JS_EVAL_FLAG_ASYNC: i32 = 1 << 7;
const JS_WRITE_OBJ_BYTECODE: i32 = 1;
const JS_WRITE_OBJ_STRIP_SOURCE: i32 = 1 << 4;
const JS_READ_OBJ_BYTECODE: i32 = 1;

fn is_exception(value: JsValue) -> bool {
    value >> 32 == JS_TAG_EXCEPTION
}

/// A started QuickJS: its context and the calls kiln makes into it (see `qjs_exports`).
pub(crate) struct Qjs {
    instance: Instance,
    memory: wasmtime::Memory,
    malloc: TypedFunc<i32, i32>,
    context: i32,
}

impl Qjs {
    /// Where the guest's linear memory starts in this process, and its size in bytes.
    pub(crate) fn linear_memory(&self, store: &Store<GuestState>) -> (usize, usize) {
        (
            self.memory.data_ptr(store) as usize,
            self.memory.data_size(store),
        )
    }

    /// Initialises the reactor and runs `qjs` with `args` (options only: kiln evaluates the
    /// code itself), in `cwd` if given.
    pub(crate) async fn start(
        store: &mut Store<GuestState>,
        instance: Instance,
        args: &[&str],
        cwd: Option<&str>,
    ) -> wasmtime::Result<Qjs> {
        let initialize: TypedFunc<(), ()> = instance.get_typed_func(&mut *store, "_initialize")?;
        let init_argv: TypedFunc<(i32, i32), i32> =
            instance.get_typed_func(&mut *store, "qjs_init_argv")?;
        let get_context: TypedFunc<(), i32> =
            instance.get_typed_func(&mut *store, "qjs_get_context")?;
        let mut qjs = Qjs {
            instance,
            memory: instance
                .get_memory(&mut *store, "memory")
                .ok_or_else(|| wasmtime::format_err!("the module exports no memory"))?,
            malloc: instance.get_typed_func(&mut *store, "malloc")?,
            context: 0,
        };
        initialize.call_async(&mut *store, ()).await?;
        if let Some(cwd) = cwd {
            // Before any JavaScript: the program's relative imports resolve against it.
            let chdir: TypedFunc<i32, i32> = qjs.func(store, qjs_exports::CHDIR)?;
            let path = qjs.write(store, &[cwd.as_bytes(), b"\0"].concat()).await?;
            if chdir.call_async(&mut *store, path).await? != 0 {
                return Err(wasmtime::format_err!("the guest could not enter {cwd}"));
            }
        }
        // One block: the NUL-terminated strings, then the pointer array. QuickJS keeps argv,
        // so the block is never freed (it lives as long as the instance).
        let strings: usize = args.iter().map(|a| a.len() + 1).sum();
        let base = qjs.alloc(store, strings + 4 * (args.len() + 1)).await?;
        let mut block = Vec::new();
        let mut pointers = Vec::with_capacity(args.len() + 1);
        for arg in args {
            pointers.push(base + i32::try_from(block.len())?);
            block.extend_from_slice(arg.as_bytes());
            block.push(0);
        }
        pointers.push(0);
        let argv = base + i32::try_from(block.len())?;
        for pointer in pointers {
            block.extend_from_slice(&pointer.to_le_bytes());
        }
        qjs.memory.write(&mut *store, base as usize, &block)?;
        let argc = i32::try_from(args.len())?;
        let status = init_argv.call_async(&mut *store, (argc, argv)).await?;
        if status != 0 {
            return Err(wasmtime::format_err!("qjs_init_argv failed ({status})"));
        }
        qjs.context = get_context.call_async(&mut *store, ()).await?;
        Ok(qjs)
    }

    /// Starts QuickJS in `cwd` and runs kiln's prelude (`std` and `os` as globals, console,
    /// timers, process).
    pub(crate) async fn with_prelude(
        store: &mut Store<GuestState>,
        instance: Instance,
        cwd: Option<&str>,
        bytecode: &Bytecode,
    ) -> wasmtime::Result<Qjs> {
        let qjs = Qjs::start(store, instance, &["qjs"], cwd).await?;
        let done = match qjs.run_bytecode(store, &bytecode.prelude).await? {
            Some(evaluated) => qjs.wait(store, evaluated).await?,
            None => None,
        };
        if done.is_none() {
            return Err(wasmtime::format_err!("kiln's JavaScript prelude failed"));
        }
        Ok(qjs)
    }

    fn func<P: wasmtime::WasmParams, R: wasmtime::WasmResults>(
        &self,
        store: &mut Store<GuestState>,
        name: &str,
    ) -> wasmtime::Result<TypedFunc<P, R>> {
        self.instance.get_typed_func(&mut *store, name)
    }

    async fn alloc(&self, store: &mut Store<GuestState>, len: usize) -> wasmtime::Result<i32> {
        let size =
            i32::try_from(len).map_err(|_| wasmtime::format_err!("{len} bytes is too large"))?;
        let at = self.malloc.call_async(&mut *store, size).await?;
        if at == 0 {
            return Err(wasmtime::format_err!(
                "the guest could not allocate {len} bytes"
            ));
        }
        Ok(at)
    }

    /// Copies `bytes` into guest memory from `malloc`, never freed: each guest writes a
    /// few.
    async fn write(&self, store: &mut Store<GuestState>, bytes: &[u8]) -> wasmtime::Result<i32> {
        let at = self.alloc(store, bytes.len()).await?;
        self.memory.write(&mut *store, at as usize, bytes)?;
        Ok(at)
    }

    /// Writes `code` and `filename`, both NUL-terminated (QuickJS reads a byte past the
    /// code): their addresses and the code's length.
    async fn write_code(
        &self,
        store: &mut Store<GuestState>,
        code: &str,
        filename: &str,
    ) -> wasmtime::Result<(i32, i32, i32)> {
        let block = [code.as_bytes(), b"\0", filename.as_bytes(), b"\0"].concat();
        let at = self.write(store, &block).await?;
        let len = i32::try_from(code.len())?;
        Ok((at, len, at + len + 1))
    }

    /// Evaluates `code` as a classic script (its `var`s become globals) named `filename`:
    /// 0 when it ran, -1 when it threw (QuickJS printed the exception on stderr). No event
    /// loop runs.
    pub(crate) async fn eval_script(
        &self,
        store: &mut Store<GuestState>,
        code: &str,
        filename: &str,
    ) -> wasmtime::Result<i32> {
        let eval: TypedFunc<(i32, i32, i32, i32, i32), i32> =
            self.func(store, qjs_exports::EVAL)?;
        let (at, len, name) = self.write_code(store, code, filename).await?;
        eval.call_async(&mut *store, (self.context, at, len, name, SCRIPT))
            .await
    }

    /// Prints the pending exception on stderr.
    async fn dump_error(&self, store: &mut Store<GuestState>) -> wasmtime::Result<()> {
        let dump: TypedFunc<i32, ()> = self.func(store, qjs_exports::DUMP_ERROR)?;
        dump.call_async(&mut *store, self.context).await
    }

    /// Compiles `source` (a script, or a module with `JS_EVAL_TYPE_MODULE`) to bytecode.
    async fn compile(
        &self,
        store: &mut Store<GuestState>,
        source: &str,
        flags: i32,
    ) -> wasmtime::Result<Vec<u8>> {
        let compile: TypedFunc<(i32, i32, i32, i32, i32), JsValue> =
            self.func(store, qjs_exports::COMPILE)?;
        let write_object: TypedFunc<(i32, i32, JsValue, i32), i32> =
            self.func(store, qjs_exports::WRITE_OBJECT)?;
        let (at, len, name) = self.write_code(store, source, "<kiln>").await?;
        let args = (
            self.context,
            at,
            len,
            name,
            flags | JS_EVAL_FLAG_COMPILE_ONLY,
        );
        let compiled = compile.call_async(&mut *store, args).await?;
        if is_exception(compiled) {
            self.dump_error(store).await?;
            return Err(wasmtime::format_err!("it does not compile"));
        }
        let size_at = self.alloc(store, 4).await?;
        let flags = JS_WRITE_OBJ_BYTECODE | JS_WRITE_OBJ_STRIP_SOURCE;
        let args = (self.context, size_at, compiled, flags);
        let buffer = write_object.call_async(&mut *store, args).await?;
        let mut size = [0u8; 4];
        self.memory.read(&*store, size_at as usize, &mut size)?;
        if buffer == 0 {
            return Err(wasmtime::format_err!("its bytecode could not be written"));
        }
        let mut bytecode = vec![0u8; u32::from_le_bytes(size) as usize];
        self.memory.read(&*store, buffer as usize, &mut bytecode)?;
        Ok(bytecode)
    }

    /// Runs `bytecode` (a script, or a module whose imports are loaded first) and answers
    /// its value, or None when it threw (printed on stderr). A module's value is the
    /// promise of its evaluation.
    async fn run_bytecode(
        &self,
        store: &mut Store<GuestState>,
        bytecode: &[u8],
    ) -> wasmtime::Result<Option<JsValue>> {
        let read_object: TypedFunc<(i32, i32, i32, i32), JsValue> =
            self.func(store, qjs_exports::READ_OBJECT)?;
        let resolve_module: TypedFunc<(i32, JsValue), i32> =
            self.func(store, qjs_exports::RESOLVE_MODULE)?;
        let at = self.write(store, bytecode).await?;
        let len = i32::try_from(bytecode.len())?;
        let args = (self.context, at, len, JS_READ_OBJ_BYTECODE);
        let value = read_object.call_async(&mut *store, args).await?;
        if value >> 32 == JS_TAG_MODULE
            && resolve_module
                .call_async(&mut *store, (self.context, value))
                .await?
                != 0
        {
            return self.threw(store).await;
        }
        self.eval_function(store, value).await
    }

    /// Compiles `code` as a module named `filename` and starts it: the promise of its
    /// evaluation, or None when it did not compile or threw at once (printed on stderr).
    pub(crate) async fn start_module(
        &self,
        store: &mut Store<GuestState>,
        code: &str,
        filename: &str,
    ) -> wasmtime::Result<Option<JsValue>> {
        let compile: TypedFunc<(i32, i32, i32, i32, i32), JsValue> =
            self.func(store, qjs_exports::COMPILE)?;
        let set_import_meta: TypedFunc<(i32, JsValue, i32, i32), i32> =
            self.func(store, qjs_exports::SET_IMPORT_META)?;
        let (at, len, name) = self.write_code(store, code, filename).await?;
        let flags = MODULE | JS_EVAL_FLAG_COMPILE_ONLY;
        let module = compile
            .call_async(&mut *store, (self.context, at, len, name, flags))
            .await?;
        if is_exception(module) {
            return self.threw(store).await;
        }
        // import.meta.url and .main, as qjs sets them for its main module.
        if set_import_meta
            .call_async(&mut *store, (self.context, module, 0, 1))
            .await?
            != 0
        {
            return self.threw(store).await;
        }
        self.eval_function(store, module).await
    }

    /// Starts `code` as a session's turn: a classic script whose declarations (`var`,
    /// `let`, `const`, functions) stay global for later turns, which may `await` at its top
    /// level. Answers its promise, or None when it did not compile (printed on stderr).
    pub(crate) async fn start_turn(
        &self,
        store: &mut Store<GuestState>,
        code: &str,
        filename: &str,
    ) -> wasmtime::Result<Option<JsValue>> {
        let compile: TypedFunc<(i32, i32, i32, i32, i32), JsValue> =
            self.func(store, qjs_exports::COMPILE)?;
        let (at, len, name) = self.write_code(store, code, filename).await?;
        let flags = SCRIPT | JS_EVAL_FLAG_ASYNC;
        let promise = compile
            .call_async(&mut *store, (self.context, at, len, name, flags))
            .await?;
        if is_exception(promise) {
            return self.threw(store).await;
        }
        Ok(Some(promise))
    }

    async fn eval_function(
        &self,
        store: &mut Store<GuestState>,
        value: JsValue,
    ) -> wasmtime::Result<Option<JsValue>> {
        let eval_function: TypedFunc<(i32, JsValue), JsValue> =
            self.func(store, qjs_exports::EVAL_FUNCTION)?;
        if is_exception(value) {
            return self.threw(store).await;
        }
        let value = eval_function
            .call_async(&mut *store, (self.context, value))
            .await?;
        if is_exception(value) {
            return self.threw(store).await;
        }
        Ok(Some(value))
    }

    /// Prints the pending exception; None.
    async fn threw(&self, store: &mut Store<GuestState>) -> wasmtime::Result<Option<JsValue>> {
        self.dump_error(store).await?;
        Ok(None)
    }

    /// Waits for `promise` (running jobs meanwhile, and checking for unhandled rejections
    /// whenever none is left): its value, or None when it was rejected (printed).
    async fn wait(
        &self,
        store: &mut Store<GuestState>,
        promise: JsValue,
    ) -> wasmtime::Result<Option<JsValue>> {
        let wait: TypedFunc<(i32, JsValue), JsValue> = self.func(store, qjs_exports::AWAIT)?;
        let value = wait
            .call_async(&mut *store, (self.context, promise))
            .await?;
        if is_exception(value) {
            return self.threw(store).await;
        }
        Ok(Some(value))
    }

    /// Runs promise jobs until none is left: false when one threw (printed).
    async fn run_jobs(&self, store: &mut Store<GuestState>, jobs: Jobs) -> wasmtime::Result<bool> {
        let execute: TypedFunc<(i32, i32), i32> =
            self.func(store, qjs_exports::EXECUTE_PENDING_JOB)?;
        loop {
            match execute
                .call_async(&mut *store, (jobs.runtime, jobs.context_out))
                .await?
            {
                0 => return Ok(true),
                1 => {}
                _ => {
                    self.dump_error(store).await?;
                    return Ok(false);
                }
            }
        }
    }

    async fn promise_state(
        &self,
        store: &mut Store<GuestState>,
        promise: JsValue,
    ) -> wasmtime::Result<i32> {
        let state: TypedFunc<(i32, JsValue), i32> = self.func(store, qjs_exports::PROMISE_STATE)?;
        state.call_async(&mut *store, (self.context, promise)).await
    }

    /// Node's event loop for the program (or turn) whose evaluation is the promise `main`:
    /// promise jobs until none is left, then (for a program) QuickJS's check for unhandled
    /// rejections, then the next timer (the host sleeps until it is due), and again, until
    /// no job and no timer is left. Answers the exit code: 1 when something threw (printed
    /// on stderr), 13 when it still awaits something that can never come, as Node's
    /// "unsettled top-level await". A timer callback that throws, an unhandled rejection
    /// (in a program) and `process.exit` end the guest instead.
    pub(crate) async fn event_loop(
        &self,
        store: &mut Store<GuestState>,
        bytecode: &Bytecode,
        main: JsValue,
        run: Run,
    ) -> wasmtime::Result<i32> {
        let get_runtime: TypedFunc<i32, i32> = self.func(store, qjs_exports::GET_RUNTIME)?;
        let jobs = Jobs {
            runtime: get_runtime.call_async(&mut *store, self.context).await?,
            context_out: self.alloc(store, 4).await?,
        };
        loop {
            // A program that threw ends before anything it queued runs, as in Node.
            if self.promise_state(store, main).await? == JS_PROMISE_REJECTED {
                self.wait(store, main).await?;
                return Ok(1);
            }
            if !self.run_jobs(store, jobs).await? {
                return Ok(1);
            }
            if self.promise_state(store, main).await? == JS_PROMISE_REJECTED {
                self.wait(store, main).await?;
                return Ok(1);
            }
            let delay = match run {
                Run::Program => match self.run_bytecode(store, &bytecode.step).await? {
                    Some(step) => self.wait(store, step).await?,
                    None => None,
                },
                Run::Turn => self.run_bytecode(store, &bytecode.delay).await?,
            };
            let Some(delay) = delay else {
                return Ok(1);
            };
            let delay_ms = match (delay >> 32, delay as i32) {
                (JS_TAG_INT, ms) => ms,
                _ => {
                    return Err(wasmtime::format_err!(
                        "the event loop's step answered {delay:#x}"
                    ));
                }
            };
            if delay_ms < 0 {
                break;
            }
            if delay_ms > 0 {
                tokio::time::sleep(std::time::Duration::from_millis(delay_ms as u64)).await;
            }
            if self.run_bytecode(store, &bytecode.fire).await?.is_none() {
                return Ok(1);
            }
        }
        if self.promise_state(store, main).await? == JS_PROMISE_PENDING {
            let warning = "std.err.puts('Warning: Detected unsettled top-level await\\n')";
            self.eval_script(store, warning, "<kiln>").await?;
            return Ok(13);
        }
        Ok(0)
    }
}

/// What `JS_ExecutePendingJob` takes: the runtime, and where it writes the job's context.
#[derive(Clone, Copy)]
struct Jobs {
    runtime: i32,
    context_out: i32,
}

/// kiln's JavaScript, as bytecode: the prelude, and the event loop's calls.
pub(crate) struct Bytecode {
    prelude: Vec<u8>,
    step: Vec<u8>,
    fire: Vec<u8>,
    delay: Vec<u8>,
}

/// What the event loop runs for: a program (a one-shot), or a session's turn, which an
/// unhandled rejection must not end (QuickJS's check exits), so it is not checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Run {
    Program,
    Turn,
}

/// kiln's prelude: `std` and `os` as globals, console, timers, process (see the file).
const PRELUDE_SOURCE: &str = include_str!("js/prelude.js");

/// The event loop's calls into the prelude (see [`Qjs::event_loop`]).
const STEP: &str = "globalThis[Symbol.for('kiln')].step()";
const FIRE: &str = "globalThis[Symbol.for('kiln')].fire()";
const DELAY: &str = "globalThis[Symbol.for('kiln')].delay()";

impl Bytecode {
    /// Compiles kiln's JavaScript in `qjs`, a guest of kiln's own.
    pub(crate) async fn compile(
        qjs: &Qjs,
        store: &mut Store<GuestState>,
    ) -> wasmtime::Result<Bytecode> {
        Ok(Bytecode {
            prelude: qjs.compile(store, PRELUDE_SOURCE, MODULE).await?,
            step: qjs.compile(store, STEP, SCRIPT).await?,
            fire: qjs.compile(store, FIRE, SCRIPT).await?,
            delay: qjs.compile(store, DELAY, SCRIPT).await?,
        })
    }
}
