"""``run.py bench arm``: its qemu plugin counts exactly the instructions an aarch64 program runs, and a case's count is
the calls' own instructions per key and KV head."""

from __future__ import annotations

import subprocess

import pytest

from lab.bench import arm

# a loop of 2 n instructions (subs and b.ne, n times), n = 1000 times the program's one digit: two runs that differ
# in that digit alone run the same instructions but for the loop's
LOOP = r"""
int main(int argc, char** argv) {
    const long n = argc > 1 ? 1000 * (argv[1][0] - '0') : 1;
    __asm__ volatile("mov x0, %0\n1: subs x0, x0, #1\nb.ne 1b" ::"r"(n) : "x0", "cc");
    return 0;
}
"""


@pytest.mark.skipif(bool(arm.missing_tools()), reason=f"needs {arm.CXX}, {arm.QEMU} and cc")
def test_the_plugin_counts_every_instruction_an_aarch64_program_runs(tmp_path):
    source, program, plugin = tmp_path / "loop.c", tmp_path / "loop", tmp_path / "libqemu_icount.so"
    source.write_text(LOOP)
    for command in (["cc", "-shared", "-fPIC", "-O2", str(arm.HERE / "qemu_icount.c"), "-o", str(plugin)],
                    [arm.CXX, "-O2", str(source), "-o", str(program)]):
        subprocess.run(command, check=True, capture_output=True, timeout=120)

    def counted(*args: str) -> int:
        done = subprocess.run([arm.QEMU, "-L", arm.SYSROOT, "-plugin", str(plugin), str(program), *args],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return int(done.stderr.split("instructions ")[1].split()[0])

    assert counted("3") - counted("1") == 2 * 2000  # (2000 more turns of the loop)


def test_a_cases_count_is_its_calls_instructions_per_key_and_kv_head(monkeypatch):
    # (calls + 1) calls less 1 call: the driver's setup and first call drop out; 8 KV heads
    monkeypatch.setattr(arm, "instructions", lambda plugin, driver, kind, keys, page, calls: 5_000 + 700 * 8 * keys *
                        calls + (300 if calls else 0))
    assert arm.per_key_head(None, None, 1, 1024, 16, 4) == pytest.approx(700)
