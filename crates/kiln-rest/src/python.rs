//! The Python modules kiln loads into each tenant's session, and the turns that call them.

const STORE: &str = include_str!("../python/store.py");
const SAFETY: &str = include_str!("../python/safety.py");
const HTTP_RESPONSE: &str = include_str!("../python/http_response.py");
const ROUTER: &str = include_str!("../python/router.py");
const DRIVER: &str = include_str!("../python/driver.py");

/// The line prefix of the driver's answer on stdout.
pub const MARK: &str = "\u{1e}kiln-rest:";

/// A Python string literal holding `text` (a JSON string literal is one: serde_json escapes
/// quotes, backslashes and control characters and writes the rest as UTF-8).
pub fn literal(text: &str) -> String {
    serde_json::to_string(text).unwrap_or_else(|_| "\"\"".into())
}

/// The first turn of a tenant's session: defines the package `kiln_rest` from the embedded
/// sources and points the driver at the tenant's folder.
pub fn loader(guest_root: &str, tenant: &str) -> String {
    let mut code = String::from(
        "import sys, types\n\
         def __kiln_load(name, src):\n\
         \x20   m = types.ModuleType(name)\n\
         \x20   m.__file__ = '<kiln>/' + name.replace('.', '/') + '.py'\n\
         \x20   m.__package__ = 'kiln_rest'\n\
         \x20   sys.modules[name] = m\n\
         \x20   exec(compile(src, m.__file__, 'exec'), m.__dict__)\n\
         \x20   return m\n\
         __kiln_pkg = types.ModuleType('kiln_rest')\n\
         __kiln_pkg.__path__ = []\n\
         sys.modules['kiln_rest'] = __kiln_pkg\n",
    );
    for (name, source) in [
        ("store", STORE),
        ("safety", SAFETY),
        ("http_response", HTTP_RESPONSE),
        ("router", ROUTER),
        ("driver", DRIVER),
    ] {
        code.push_str(&format!(
            "__kiln_pkg.{name} = __kiln_load('kiln_rest.{name}', {})\n",
            literal(source)
        ));
    }
    code.push_str(&format!(
        "__kiln_rest = sys.modules['kiln_rest.driver']\n\
         __kiln_rest.init({}, {})\n\
         del __kiln_load, __kiln_pkg\n",
        literal(guest_root),
        literal(tenant)
    ));
    code
}

/// Plan with the conventions planner and run the plan.
pub fn handle(ctx: &str) -> String {
    format!("__kiln_rest.handle({}, 'conventions')", literal(ctx))
}

/// Ask the LLM (through the door) for a plan.
pub fn plan(ctx: &str) -> String {
    format!("__kiln_rest.plan({})", literal(ctx))
}

/// Run a plan's code; `meta` is what the plan said beside it (action, resource, response
/// hints), as the driver reported it.
pub fn execute(ctx: &str, code: &str, pattern: Option<&str>, meta: &serde_json::Value) -> String {
    let pattern = pattern.map_or_else(|| "None".to_string(), literal);
    format!(
        "__kiln_rest.execute({}, {}, {pattern}, {})",
        literal(ctx),
        literal(code),
        literal(&meta.to_string())
    )
}

/// The driver's answer in a turn's stdout: the last line that starts with [`MARK`].
pub fn answer(stdout: &str) -> Option<serde_json::Value> {
    stdout
        .lines()
        .rev()
        .find_map(|line| line.strip_prefix(MARK))
        .and_then(|json| serde_json::from_str(json).ok())
}
