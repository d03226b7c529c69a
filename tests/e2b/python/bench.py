"""E2B SDK figures against kiln (scripts/e2b-check --bench): the median over N runs of
- Sandbox.create() (code interpreter) then the first run_code("1+1") result,
- Sandbox.create("base") then commands.run("echo hi"),
- run_code("1+1") and commands.run("echo hi") in a sandbox that already runs.
Each sandbox is killed after its run (not timed)."""

import statistics
import sys
import time

from e2b import Sandbox
from e2b_code_interpreter import Sandbox as CodeInterpreter

N = int(sys.argv[1]) if len(sys.argv) > 1 else 50


def timed(run):
    samples = []
    for _ in range(N):
        started = time.perf_counter()
        cleanup = run()
        samples.append((time.perf_counter() - started) * 1000)
        if cleanup:
            cleanup()
    samples.sort()
    return statistics.median(samples), samples[int(len(samples) * 0.9) - 1]


def first_result():
    sbx = CodeInterpreter.create()
    assert sbx.run_code("1+1").text == "2"
    return sbx.kill


def first_command():
    sbx = Sandbox.create("base")
    assert sbx.commands.run("echo hi").stdout == "hi\n"
    return sbx.kill


rows = [
    ("create + first run_code('1+1') (code-interpreter-v1, WebAssembly)", timed(first_result)),
    ("create + commands.run('echo hi') (base, Linux box)", timed(first_command)),
]
warm_ci = CodeInterpreter.create()
warm_ci.run_code("0")
rows.append(("run_code('1+1'), sandbox running", timed(lambda: warm_ci.run_code("1+1") and None)))
warm_ci.kill()
warm = Sandbox.create("base")
warm.commands.run("true")
rows.append(("commands.run('echo hi'), sandbox running", timed(lambda: warm.commands.run("echo hi") and None)))
warm.kill()
print(f"E2B SDK against kiln, {N} runs each (milliseconds)")
print(f"{'':70} {'median':>8} {'p90':>8}")
for name, (median, p90) in rows:
    print(f"{name:70} {median:8.1f} {p90:8.1f}")
