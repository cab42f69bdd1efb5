"""How fast the calculator answers on a phone-class CPU: every kind of change, timed in Chromium.

    .venv/bin/python bench/fit_ui_bench.py                        # builds the site, writes results/fit_ui_bench.json
    .venv/bin/python bench/fit_ui_bench.py --out /tmp/ui.json     # anywhere else

The site is built (or ``--site-dir`` names one already built) and served on 127.0.0.1; Debian's
Chromium opens ``/fit/`` at 390 px with its CPU throttled ``--throttle`` times (DevTools'
``Emulation.setCPUThrottlingRate``). Each change (a keystroke's input event, or a choice) is made
``--repeats`` times back and forth, and each time the recomputation, the redraw and the page's
layout are timed (``performance.now()`` around the event and a forced layout). The median of each
change is held against 50 ms (issue 13's target for the calculator on a phone). These are this
machine's milliseconds: another process busy meanwhile shows in them, which is why the target is
a benchmark's and never a test's (tests/test_browser.py checks that every change updates the answer).
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from labkit import cli, files, provenance
from labkit.config import LabConfig, UsageError, option

ROOT = Path(__file__).resolve().parents[1]
BENCH = "fit_ui"
RESULT_FILE = "results/fit_ui_bench.json"
CPU_ONLY = True  # the calculator runs in the reader's browser: a CPU figure by nature
TARGET_MS = 50
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"]

#: (field, a value, the value to go back to): every kind of change a reader makes, training then serving
TRAIN = [("seq", "8192", "4096"), ("seq", "81920", "819"), ("precision", "bf16", "mixed"),
         ("checkpointing", "full", "none"), ("dp", "8", "1"), ("model", "mixtral-8x7b", "llama-3-70b"),
         ("batch", "4", "1"), ("method", "lora", "full"), ("task", "serve", "train"), ("gpu", "l4-24gb", "h100-80gb")]
SERVE = [("context", "32768", "8192"), ("requests", "256", "32"), ("kv_dtype", "fp8", "bf16")]

#: one change made as a reader makes it; returns the milliseconds to the laid-out answer
CHANGE = """([name, value]) => {
  const el = document.getElementById('fit-' + name);
  const t0 = performance.now();
  el.value = value;
  el.dispatchEvent(new Event(el.tagName === 'SELECT' ? 'change' : 'input', {bubbles: true}));
  void document.body.offsetHeight;  // style and layout of the new result, included
  return performance.now() - t0;
}"""


@dataclass
class Config(LabConfig):
    """Time the calculator's update on a throttled Chromium, each kind of change."""

    site_dir: Path | None = option(None, "a site already built by `mkdocs build` (default: build one now)",
                                   path="folder")
    throttle: int = option(4, "Chromium's CPU slowdown factor (4: a phone-class CPU)", min=1, max=20)
    repeats: int = option(5, "times each change is made, back and forth (the median is reported)", min=1, max=51)
    out: Path | None = option(None, "where to write the results (default: results/fit_ui_bench.json)", path="write")


class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


def build_site(into: Path) -> Path:
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "--site-dir", str(into)],
                          cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, NO_MKDOCS_2_WARNING="1"))
    if proc.returncode:
        raise RuntimeError(f"mkdocs build failed: {(proc.stderr or proc.stdout).strip().splitlines()[-1:]}")
    return into


def measure(site: Path, throttle: int, repeats: int) -> dict[str, list[float]]:
    """Milliseconds of each change, ``repeats`` times each, on /fit/ served from ``site``."""
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(site)))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    times: dict[str, list[float]] = {}
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=ARGS, headless=True)
            ctx = browser.new_context(viewport={"width": 390, "height": 844}, is_mobile=True)
            page = ctx.new_page()
            page.goto(f"http://127.0.0.1:{httpd.server_address[1]}/fit/", wait_until="load")
            page.wait_for_selector("#fit-total[data-bytes]", timeout=15_000)
            ctx.new_cdp_session(page).send("Emulation.setCPUThrottlingRate", {"rate": throttle})
            page.evaluate(CHANGE, ["seq", "2048"])  # warm-up
            for changes in (TRAIN, SERVE):
                if changes is SERVE:
                    page.evaluate(CHANGE, ["task", "serve"])
                for name, a, b in changes:
                    values = [(a, b)[i % 2] for i in range(repeats)]
                    times[f"{name}={a}"] = [page.evaluate(CHANGE, [name, v]) for v in values]
            browser.close()
    finally:
        httpd.shutdown()
    return times


def run(config: Config) -> dict:
    out = config.out or ROOT / RESULT_FILE
    files.check_writable(out, "--out")
    if not (shutil.which("chromium") or shutil.which("chromium-browser")):
        raise UsageError("this benchmark needs Debian's chromium (apt install chromium)")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        site = config.site_dir or build_site(Path(tmp) / "site")
        times = measure(site, config.throttle, config.repeats)
    median = {name: sorted(ms)[len(ms) // 2] for name, ms in times.items()}
    rows = [{"metric": f"calculator update, {name}: median of {config.repeats}", "value": ms, "unit": "ms",
             "target": f"< {TARGET_MS}", "lab": "fit", "note": f"Chromium, CPU throttled {config.throttle}x, 390 px"}
            for name, ms in median.items()]
    result = {"bench": BENCH, "device": "cpu", "cores": os.cpu_count(), "throttle": config.throttle,
              "times_ms": times, "median_ms": median, "summary_rows": rows,
              "note": "the reader's browser does this work: these are this machine's milliseconds, throttled"}
    record = provenance.collect(None, cli.pick_device("cpu"), time.perf_counter() - t0)
    provenance.write_results(out, result, record)
    return {"provenance": record, "out": str(out), **result}


def report(result: dict) -> None:
    median = result["median_ms"]
    slow = max(median, key=median.get)
    print(f"calculator update, Chromium throttled {result['throttle']}x at 390 px -> {result['out']}")
    for name, ms in median.items():
        print(f"  {name:<24} median {ms:6.1f} ms{'  (over the target)' if ms >= TARGET_MS else ''}")
    print(f"slowest: {slow} at {median[slow]:.1f} ms; target: every median under {TARGET_MS} ms")


if __name__ == "__main__":
    cli.main(Config, run, report)
