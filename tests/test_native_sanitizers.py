"""The C code under AddressSanitizer and UBSan: the shared-memory program on fuzzed
programs, and the decode kernel and merge on fuzzed shapes, strides and buffer sizes.

``tests/native/shm_program_fuzz.c`` drives ``treeattn_shm_program`` with generated valid
programs (which must run to the end) and the same programs with one op made hostile (outside
the segment, misaligned, over its own counters, the wrong size, an unknown kind, short of
scratch), which the C code must refuse before touching memory; plus a receive nobody sends,
a peer header that lies about the size and an overflowing shape. Every buffer is exactly as
large as the program is owed, so any byte past one is a sanitizer report and a failure.
``tests/native/kernels_fuzz.c`` hands the decode kernel and the merge buffers allocated at
exactly the capacities it tells them: an exact fit must run clean, and a buffer one element
short, too few output rows, a negative stride or an overflowing length must be refused
before anything is touched. Skipped where the compiler cannot build with the sanitizers.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from treeattn.testbed.kernels import cpu_native
from treeattn.testbed.transport.shm_program import SOURCES

pytestmark = pytest.mark.timeout(300)
HARNESS = Path(__file__).parent / "native" / "shm_program_fuzz.c"
SANITIZE = ("-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-g", "-O0")


KERNELS_HARNESS = Path(__file__).parent / "native" / "kernels_fuzz.c"
ENV = {"ASAN_OPTIONS": "detect_leaks=1:abort_on_error=0", "UBSAN_OPTIONS": "print_stacktrace=1"}


def _build(tmp_path_factory, harness: Path, sources) -> Path:
    compiler = cpu_native._compiler()
    if compiler is None:
        pytest.skip("no C compiler")
    out = tmp_path_factory.mktemp("asan") / harness.stem
    result = subprocess.run([*compiler, *SANITIZE, str(harness), *map(str, sources), "-lm",
                             "-o", str(out)], capture_output=True, text=True, timeout=240)
    if result.returncode != 0:
        pytest.skip(f"the compiler cannot build with the sanitizers: {result.stderr[-300:]}")
    return out


@pytest.fixture(scope="module")
def fuzzer(tmp_path_factory) -> Path:
    return _build(tmp_path_factory, HARNESS, SOURCES)


@pytest.mark.parametrize("seed", [1, 2])
def test_fuzzed_kernel_calls_are_sanitizer_clean(tmp_path_factory, seed):
    binary = _build(tmp_path_factory, KERNELS_HARNESS, cpu_native.SOURCES)
    result = subprocess.run([str(binary), str(seed), "150"], capture_output=True, text=True,
                            timeout=240, env=ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "150 cases" in result.stdout


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_fuzzed_programs_are_sanitizer_clean(fuzzer, seed):
    result = subprocess.run([str(fuzzer), str(seed), "700"], capture_output=True, text=True,
                            timeout=240, env=ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "700 cases" in result.stdout
