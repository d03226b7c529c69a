//! Exports the QuickJS reactor's build left internal.
//!
//! The reactor exports only `qjs_init_argv`, which evaluates one `-e` expression or file and
//! returns: nothing runs the promise jobs and timers left behind, and nothing can evaluate
//! a second piece of code. Its `eval_buf` does both (compiles, links and runs a script or a
//! module, then runs jobs and timers until the module's promise settles), and the module
//! keeps a `name` section, so kiln adds an export for it before compiling: the export
//! section is rewritten, nothing else. Functions are found by name and their signatures
//! checked, never by index, and the patch applies only to the exact file it was written for
//! (by digest): another build is refused with a message, not run with a guess.
//!
//! The patched module is compiled under its own cache key ([`key_tag`]), so a `.cwasm`
//! compiled from the unpatched file is never loaded for it.

use sha2::{Digest, Sha256};

use crate::setup::{JAVASCRIPT, PYTHON};

/// A value type in a function signature.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ValType {
    I32,
    I64,
    F32,
    F64,
    /// `v128` or a single-byte reference type (`funcref`, `externref`, `exnref`): never in
    /// a signature kiln exports, but present in modules it patches.
    Other,
}

impl ValType {
    fn from_byte(byte: u8) -> Option<ValType> {
        Some(match byte {
            0x7f => ValType::I32,
            0x7e => ValType::I64,
            0x7d => ValType::F32,
            0x7c => ValType::F64,
            0x7b | 0x70 | 0x6f | 0x69 => ValType::Other,
            _ => return None,
        })
    }
}

/// An internal function kiln exports, and the signature it must have.
pub(crate) struct Export {
    /// The export's name.
    pub name: &'static str,
    /// The function's name in the `name` section.
    pub function: &'static str,
    pub params: &'static [ValType],
    pub results: &'static [ValType],
}

use ValType::{I32, I64};

/// `int eval_buf(JSContext *ctx, const void *buf, int len, const char *filename, int flags)`
/// from `qjs.c`: evaluates `buf` (NUL-terminated) as a script (`flags` 0) or a module (1).
/// Prints an uncaught exception to stderr and answers -1; 0 otherwise.
pub(crate) const EVAL: &str = "kiln_eval";
/// `JSValue JS_Eval(ctx, buf, len, filename, flags)`: with `JS_EVAL_FLAG_COMPILE_ONLY`,
/// compiles without running.
pub(crate) const COMPILE: &str = "kiln_compile";
/// `uint8_t *JS_WriteObject(ctx, size_t *size, JSValue obj, int flags)`: serialises
/// (bytecode, with `JS_WRITE_OBJ_BYTECODE`) into a buffer from `malloc`.
pub(crate) const WRITE_OBJECT: &str = "kiln_write_object";
/// `JSValue JS_ReadObject(ctx, const uint8_t *buf, size_t len, int flags)`.
pub(crate) const READ_OBJECT: &str = "kiln_read_object";
/// `int JS_ResolveModule(ctx, JSValue module)`: loads the imports of a module read from
/// bytecode.
pub(crate) const RESOLVE_MODULE: &str = "kiln_resolve_module";
/// `int js_module_set_import_meta(ctx, JSValue module, bool use_realpath, bool is_main)`.
pub(crate) const SET_IMPORT_META: &str = "kiln_set_import_meta";
/// `JSValue JS_EvalFunction(ctx, JSValue fun)`: runs compiled code (and frees `fun`); for a
/// module, answers the promise of its evaluation.
pub(crate) const EVAL_FUNCTION: &str = "kiln_eval_function";
/// `JSRuntime *JS_GetRuntime(ctx)`.
pub(crate) const GET_RUNTIME: &str = "kiln_get_runtime";
/// `int JS_ExecutePendingJob(JSRuntime *rt, JSContext **pctx)`: runs one promise job; 1
/// when it ran, 0 when none was pending, -1 when it threw.
pub(crate) const EXECUTE_PENDING_JOB: &str = "kiln_execute_pending_job";
/// `JSPromiseStateEnum JS_PromiseState(ctx, JSValue promise)`: 0 pending, 1 fulfilled,
/// 2 rejected.
pub(crate) const PROMISE_STATE: &str = "kiln_promise_state";
/// `JSValue js_std_await(ctx, JSValue obj)`: runs jobs until the promise `obj` settles,
/// checking for unhandled rejections (printed, then `exit(1)`) whenever the job queue is
/// empty; answers its value or an exception.
pub(crate) const AWAIT: &str = "kiln_await";
/// `void js_std_dump_error(ctx)`: prints the pending exception on stderr.
pub(crate) const DUMP_ERROR: &str = "kiln_dump_error";
/// wasi-libc's `int chdir(const char *path)`: its working directory, which relative module
/// paths resolve against before any JavaScript runs.
pub(crate) const CHDIR: &str = "kiln_chdir";

const fn export(
    name: &'static str,
    function: &'static str,
    params: &'static [ValType],
    results: &'static [ValType],
) -> Export {
    Export {
        name,
        function,
        params,
        results,
    }
}

/// What kiln adds. A `JSValue` is an `i64` in this build (NaN-boxed: its tag in the high
/// 32 bits).
const EXPORTS: &[Export] = &[
    export(EVAL, "eval_buf", &[I32; 5], &[I32]),
    export(COMPILE, "JS_Eval", &[I32; 5], &[I64]),
    export(
        WRITE_OBJECT,
        "JS_WriteObject",
        &[I32, I32, I64, I32],
        &[I32],
    ),
    export(READ_OBJECT, "JS_ReadObject", &[I32; 4], &[I64]),
    export(RESOLVE_MODULE, "JS_ResolveModule", &[I32, I64], &[I32]),
    export(
        SET_IMPORT_META,
        "js_module_set_import_meta",
        &[I32, I64, I32, I32],
        &[I32],
    ),
    export(EVAL_FUNCTION, "JS_EvalFunction", &[I32, I64], &[I64]),
    export(GET_RUNTIME, "JS_GetRuntime", &[I32], &[I32]),
    export(
        EXECUTE_PENDING_JOB,
        "JS_ExecutePendingJob",
        &[I32, I32],
        &[I32],
    ),
    export(PROMISE_STATE, "JS_PromiseState", &[I32, I64], &[I32]),
    export(AWAIT, "js_std_await", &[I32, I64], &[I64]),
    export(DUMP_ERROR, "js_std_dump_error", &[I32], &[]),
    export(CHDIR, "chdir", &[I32], &[I32]),
];

/// What kiln adds to the Python runtime: wasi-libc's `chdir`, so a guest enters its
/// workspace with one call before its first turn instead of a turn of Python of its own
/// (which cost a one-shot about 0.5 ms).
pub(crate) const PYTHON_EXPORTS: &[Export] = &[export(CHDIR, "chdir", &[I32], &[I32])];

/// The exports kiln adds to the pinned runtime with this digest, if it patches it.
fn exports_for(wasm_sha256: &str) -> Option<&'static [Export]> {
    if wasm_sha256 == JAVASCRIPT.files[0].sha256 {
        Some(EXPORTS)
    } else if wasm_sha256 == PYTHON.files[0].sha256 {
        Some(PYTHON_EXPORTS)
    } else {
        None
    }
}

/// Raised when the patch's logic changes; part of the cache key, with the list of exports.
const PATCH_VERSION: u32 = 1;

/// Why the reactor could not be patched.
#[derive(Debug, thiserror::Error)]
pub enum PatchError {
    /// The bytes are not the pinned file the patch was written for.
    #[error(
        "the runtime on disk has SHA-256 {actual}, not the pinned {expected}; delete the cache folder's runtimes/ and run `kiln setup`"
    )]
    NotPinned { expected: String, actual: String },
    /// The module could not be read as WebAssembly.
    #[error("the runtime is not a WebAssembly module kiln can read: {0}")]
    Malformed(&'static str),
    /// The run whose memory a primed module starts from failed.
    #[error("could not prime the runtime: {0}")]
    Priming(String),
    /// A function kiln exports is missing or has another signature.
    #[error(
        "the runtime has no function `{function}` with the signature kiln exports as `{export}` ({found})"
    )]
    Missing {
        function: &'static str,
        export: &'static str,
        found: &'static str,
    },
}

/// What to add to a `.cwasm` name for the wasm with this digest: empty when kiln compiles it
/// unchanged.
pub(crate) fn key_tag(wasm_sha256: &str) -> String {
    let Some(exports) = exports_for(wasm_sha256) else {
        return String::new();
    };
    let mut hasher = Sha256::new();
    hasher.update(PATCH_VERSION.to_le_bytes());
    for export in exports {
        hasher.update(format!("{}={};", export.name, export.function));
    }
    format!("-kiln{}", &hex::encode(hasher.finalize())[..8])
}

/// The bytes kiln compiles for the wasm pinned as `wasm_sha256`: `wasm` itself, or for the
/// QuickJS reactor and the Python runtime, `wasm` checked against its digest and patched.
pub(crate) fn prepare(wasm_sha256: &str, wasm: Vec<u8>) -> Result<Vec<u8>, PatchError> {
    let Some(exports) = exports_for(wasm_sha256) else {
        return Ok(wasm);
    };
    let actual = hex::encode(Sha256::digest(&wasm));
    if actual != wasm_sha256 {
        return Err(PatchError::NotPinned {
            expected: wasm_sha256.to_owned(),
            actual,
        });
    }
    add_exports(&wasm, exports)
}

/// A cursor over a module's bytes.
pub(crate) struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

const TRUNCATED: PatchError = PatchError::Malformed("truncated");

impl<'a> Reader<'a> {
    pub(crate) fn new(bytes: &'a [u8]) -> Reader<'a> {
        Reader { bytes, at: 0 }
    }

    pub(crate) fn at(&self) -> usize {
        self.at
    }

    pub(crate) fn done(&self) -> bool {
        self.at >= self.bytes.len()
    }

    pub(crate) fn byte(&mut self) -> Result<u8, PatchError> {
        let byte = *self.bytes.get(self.at).ok_or(TRUNCATED)?;
        self.at += 1;
        Ok(byte)
    }

    pub(crate) fn u32(&mut self) -> Result<u32, PatchError> {
        let mut value: u64 = 0;
        for shift in (0..35).step_by(7) {
            let byte = self.byte()?;
            value |= u64::from(byte & 0x7f) << shift;
            if byte & 0x80 == 0 {
                return u32::try_from(value)
                    .map_err(|_| PatchError::Malformed("a LEB128 over 32 bits"));
            }
        }
        Err(PatchError::Malformed("a LEB128 over 5 bytes"))
    }

    pub(crate) fn take(&mut self, len: usize) -> Result<&'a [u8], PatchError> {
        let end = self.at.checked_add(len).ok_or(TRUNCATED)?;
        let slice = self.bytes.get(self.at..end).ok_or(TRUNCATED)?;
        self.at = end;
        Ok(slice)
    }

    fn name(&mut self) -> Result<&'a [u8], PatchError> {
        let len = self.u32()? as usize;
        self.take(len)
    }
}

pub(crate) fn write_u32(out: &mut Vec<u8>, mut value: u32) {
    loop {
        let byte = (value & 0x7f) as u8;
        value >>= 7;
        if value == 0 {
            out.push(byte);
            return;
        }
        out.push(byte | 0x80);
    }
}

const SECTION_CUSTOM: u8 = 0;
const SECTION_TYPE: u8 = 1;
const SECTION_IMPORT: u8 = 2;
const SECTION_FUNCTION: u8 = 3;
const SECTION_EXPORT: u8 = 7;
const EXPORT_FUNC: u8 = 0;

/// What the patch needs to know of a module.
#[derive(Default)]
struct Layout<'a> {
    /// Each type's (params, results).
    types: Vec<(Vec<ValType>, Vec<ValType>)>,
    /// Each function's type index, imported functions first.
    functions: Vec<u32>,
    /// The `name` section's function names.
    names: Vec<(u32, &'a [u8])>,
    /// The export section's entries (count, then the bytes after it).
    exports: Option<(u32, &'a [u8])>,
    /// Every section as (id, contents), in order.
    sections: Vec<(u8, &'a [u8])>,
}

/// The module with `exports` added to its export section.
pub(crate) fn add_exports(wasm: &[u8], exports: &[Export]) -> Result<Vec<u8>, PatchError> {
    let layout = read_layout(wasm)?;
    let (count, entries) = layout
        .exports
        .ok_or(PatchError::Malformed("no export section"))?;
    let mut added = Vec::new();
    for export in exports {
        let index = find_function(&layout, export)?;
        write_u32(&mut added, export.name.len() as u32);
        added.extend_from_slice(export.name.as_bytes());
        added.push(EXPORT_FUNC);
        write_u32(&mut added, index);
    }
    if exported_names(count, entries)?
        .iter()
        .any(|name| exports.iter().any(|e| e.name.as_bytes() == *name))
    {
        return Err(PatchError::Malformed("it already exports a name kiln adds"));
    }
    let mut out = Vec::with_capacity(wasm.len() + added.len() + 16);
    out.extend_from_slice(&wasm[..8]);
    for &(id, contents) in &layout.sections {
        let mut body;
        let contents = if id == SECTION_EXPORT {
            body = Vec::with_capacity(contents.len() + added.len() + 5);
            write_u32(&mut body, count + exports.len() as u32);
            body.extend_from_slice(entries);
            body.extend_from_slice(&added);
            &body[..]
        } else {
            contents
        };
        out.push(id);
        write_u32(&mut out, contents.len() as u32);
        out.extend_from_slice(contents);
    }
    Ok(out)
}

fn find_function(layout: &Layout<'_>, export: &Export) -> Result<u32, PatchError> {
    let missing = |found| PatchError::Missing {
        function: export.function,
        export: export.name,
        found,
    };
    let mut matches = layout
        .names
        .iter()
        .filter(|(_, name)| *name == export.function.as_bytes());
    let (index, _) = matches.next().ok_or(missing("no such name"))?;
    if matches.next().is_some() {
        return Err(missing("the name is not unique"));
    }
    let ty = layout
        .functions
        .get(*index as usize)
        .and_then(|ty| layout.types.get(*ty as usize))
        .ok_or(missing("the name points at no function"))?;
    if ty.0 != export.params || ty.1 != export.results {
        return Err(missing("its signature differs"));
    }
    Ok(*index)
}

fn exported_names(count: u32, entries: &[u8]) -> Result<Vec<&[u8]>, PatchError> {
    let mut reader = Reader::new(entries);
    let mut names = Vec::new();
    for _ in 0..count {
        names.push(reader.name()?);
        reader.byte()?;
        reader.u32()?;
    }
    if !reader.done() {
        return Err(PatchError::Malformed("bytes after the exports"));
    }
    Ok(names)
}

fn read_layout(wasm: &[u8]) -> Result<Layout<'_>, PatchError> {
    if wasm.get(..8) != Some(b"\0asm\x01\0\0\0") {
        return Err(PatchError::Malformed("not a WebAssembly 1 module"));
    }
    let mut layout = Layout::default();
    let mut reader = Reader::new(&wasm[8..]);
    while !reader.done() {
        let id = reader.byte()?;
        let len = reader.u32()? as usize;
        let contents = reader.take(len)?;
        layout.sections.push((id, contents));
        let mut section = Reader::new(contents);
        match id {
            SECTION_TYPE => read_types(&mut section, &mut layout)?,
            SECTION_IMPORT => read_imports(&mut section, &mut layout)?,
            SECTION_FUNCTION => {
                for _ in 0..section.u32()? {
                    layout.functions.push(section.u32()?);
                }
            }
            SECTION_EXPORT => {
                let count = section.u32()?;
                layout.exports = Some((count, &contents[section.at..]));
            }
            SECTION_CUSTOM if section.name()? == b"name" => {
                read_function_names(&mut section, &mut layout)?;
            }
            _ => {}
        }
    }
    Ok(layout)
}

fn read_types(section: &mut Reader<'_>, layout: &mut Layout<'_>) -> Result<(), PatchError> {
    for _ in 0..section.u32()? {
        if section.byte()? != 0x60 {
            return Err(PatchError::Malformed("a type that is not a function type"));
        }
        let mut list = || -> Result<Vec<ValType>, PatchError> {
            let count = section.u32()?;
            (0..count)
                .map(|_| {
                    ValType::from_byte(section.byte()?)
                        .ok_or(PatchError::Malformed("a value type kiln does not know"))
                })
                .collect()
        };
        let params = list()?;
        let results = list()?;
        layout.types.push((params, results));
    }
    Ok(())
}

fn read_imports(section: &mut Reader<'_>, layout: &mut Layout<'_>) -> Result<(), PatchError> {
    for _ in 0..section.u32()? {
        section.name()?;
        section.name()?;
        match section.byte()? {
            0x00 => layout.functions.push(section.u32()?),
            // The reactor imports only functions; anything else would need its own reader.
            _ => return Err(PatchError::Malformed("an import that is not a function")),
        }
    }
    Ok(())
}

/// Reads the function names (subsection 1) of a `name` section.
fn read_function_names<'a>(
    section: &mut Reader<'a>,
    layout: &mut Layout<'a>,
) -> Result<(), PatchError> {
    while !section.done() {
        let kind = section.byte()?;
        let len = section.u32()? as usize;
        let contents = section.take(len)?;
        if kind != 1 {
            continue;
        }
        let mut names = Reader::new(contents);
        for _ in 0..names.u32()? {
            let index = names.u32()?;
            layout.names.push((index, names.name()?));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A module with one import, two functions, an export and a `name` section.
    fn module() -> Vec<u8> {
        let mut wasm = b"\0asm\x01\0\0\0".to_vec();
        let mut section = |id: u8, body: &[u8]| {
            wasm.push(id);
            write_u32(&mut wasm, body.len() as u32);
            wasm.extend_from_slice(body);
        };
        // Types: 0 = () -> (), 1 = (i32 x5) -> i32.
        section(
            SECTION_TYPE,
            &[
                2, 0x60, 0, 0, 0x60, 5, 0x7f, 0x7f, 0x7f, 0x7f, 0x7f, 1, 0x7f,
            ],
        );
        section(SECTION_IMPORT, &[1, 1, b'm', 1, b'f', 0x00, 0]);
        section(SECTION_FUNCTION, &[2, 0, 1]);
        section(SECTION_EXPORT, &[1, 4, b'm', b'a', b'i', b'n', 0, 1]);
        section(10, &[2, 2, 0, 0x0b, 2, 0, 0x0b]);
        let mut names = vec![4, b'n', b'a', b'm', b'e', 1];
        let entries = [3, 0, 1, b'f', 1, 4, b'm', b'a', b'i', b'n', 2, 8];
        write_u32(&mut names, (entries.len() + 8) as u32);
        names.extend_from_slice(&entries);
        names.extend_from_slice(b"eval_buf");
        section(SECTION_CUSTOM, &names);
        wasm
    }

    const EVAL_ONLY: &[Export] = &[export(EVAL, "eval_buf", &[I32; 5], &[I32])];

    #[test]
    fn adds_the_export_by_name_and_keeps_the_rest() -> Result<(), PatchError> {
        let original = module();
        let patched = add_exports(&original, EVAL_ONLY)?;
        let layout = read_layout(&patched)?;
        let (count, entries) = layout.exports.ok_or(TRUNCATED)?;
        assert_eq!(
            exported_names(count, entries)?,
            vec![&b"main"[..], b"kiln_eval"]
        );
        // kiln_eval points at function 2 (`eval_buf`).
        assert_eq!(entries.last(), Some(&2));
        let before = read_layout(&original)?;
        assert_eq!(before.sections.len(), layout.sections.len());
        for (a, b) in before.sections.iter().zip(&layout.sections) {
            assert_eq!(a.0, b.0);
            if a.0 != SECTION_EXPORT {
                assert_eq!(a.1, b.1);
            }
        }
        Ok(())
    }

    #[test]
    fn refuses_a_missing_name_a_wrong_signature_and_a_second_patch() -> Result<(), PatchError> {
        let renamed: Vec<u8> = {
            let mut wasm = module();
            let at = wasm.len() - 8;
            wasm[at..].copy_from_slice(b"eval_baz");
            wasm
        };
        let err = add_exports(&renamed, EVAL_ONLY).err().ok_or(TRUNCATED)?;
        assert_eq!(
            err.to_string(),
            "the runtime has no function `eval_buf` with the signature kiln exports as `kiln_eval` (no such name)"
        );
        let mut retyped = module();
        // Function 2's type index: 0 (`() -> ()`).
        let at = retyped
            .windows(4)
            .position(|w| w == [SECTION_FUNCTION, 3, 2, 0])
            .ok_or(TRUNCATED)?;
        retyped[at + 4] = 0;
        let err = add_exports(&retyped, EVAL_ONLY).err().ok_or(TRUNCATED)?;
        assert!(
            err.to_string().ends_with("(its signature differs)"),
            "{err}"
        );
        let twice = add_exports(&add_exports(&module(), EVAL_ONLY)?, EVAL_ONLY)
            .err()
            .ok_or(TRUNCATED)?;
        assert_eq!(
            twice.to_string(),
            "the runtime is not a WebAssembly module kiln can read: it already exports a name kiln adds"
        );
        Ok(())
    }

    #[test]
    fn only_the_pinned_runtimes_are_patched() -> Result<(), PatchError> {
        let other = "0".repeat(64);
        assert_eq!(key_tag(&other), "");
        assert_eq!(prepare(&other, vec![1, 2, 3])?, vec![1, 2, 3]);
        for pinned in [JAVASCRIPT.files[0].sha256, PYTHON.files[0].sha256] {
            assert!(key_tag(pinned).starts_with("-kiln"), "{}", key_tag(pinned));
            assert_eq!(key_tag(pinned).len(), 13);
            let err = prepare(pinned, module()).err().ok_or(TRUNCATED)?;
            assert!(matches!(err, PatchError::NotPinned { .. }), "{err}");
        }
        // Each runtime's list of exports is its own key: a change to one never reuses the
        // other's files, nor an older list's.
        assert_ne!(
            key_tag(JAVASCRIPT.files[0].sha256),
            key_tag(PYTHON.files[0].sha256)
        );
        Ok(())
    }
}
