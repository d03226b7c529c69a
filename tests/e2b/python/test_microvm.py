"""A microVM through E2B's SDK, unchanged: `Sandbox.create("base-vm")` is kiln's `vm-python`,
a Linux template booted under QEMU (scripts/e2b-check starts kiln with --linux --vm), with
its own kernel; commands, files and the working folder behave as in "base"."""

from e2b import Sandbox


def test_base_vm_is_a_microvm_with_commands_and_files(sandbox_factory):
    sbx = sandbox_factory("base-vm")
    host = open("/proc/sys/kernel/osrelease").read().strip()
    # The first command boots the VM (seconds under a software CPU).
    kernel = sbx.commands.run("uname -r", timeout=180).stdout.strip()
    assert kernel and kernel != host
    assert sbx.commands.run("pwd; whoami").stdout == "/home/user\nuser\n"
    assert sbx.commands.run("python3 -c 'print(6*7)'").stdout == "42\n"
    sbx.files.write("/home/user/notes/hello.txt", "from the SDK")
    assert sbx.commands.run("cat notes/hello.txt").stdout == "from the SDK"
    sbx.commands.run("echo from the vm > made.txt")
    assert sbx.files.read("/home/user/made.txt") == "from the vm\n"
    assert Sandbox.connect(sbx.sandbox_id).commands.run("cat made.txt").stdout == "from the vm\n"
