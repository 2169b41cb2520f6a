"""Wall time, peak memory and per-layer speed of the calibration stages on one model.

Runs, as child processes, one after the other::

    pi-profile MODEL_DIR --data TEXT --out OUT/activation --max-tokens N --work-dir OUT/profile-work
    pi-train-predictor MODEL_DIR --data TEXT --out OUT/predictor --work-dir OUT/predictor-work \\
        --max-tokens N --heldout-tokens M --epochs E

adding ``--threads``/``--device``/``--dtype`` only when given here. A flag the installed
CLI does not list in its ``--help`` (say ``--device`` before the streaming rewrite) is
left out with a note, so the script runs against older and newer CLIs alike. The
children's stdout and stderr go straight to this terminal.

Per stage it measures the wall time, the CPU time (user + system) and the peak
resident memory of that child alone: ``os.wait4`` on its pid returns its rusage, whose
``ru_maxrss`` (KiB on Linux) covers the child and nothing else of this process. That
figure counts the touched pages of memory-mapped files too (safetensors shards read
through ``safe_open`` stay mapped while their handle is open), which the kernel can drop
under pressure, so a thread also samples the child's ``/proc/PID/status`` every 0.1 s
and keeps the peaks of ``RssAnon`` (allocated memory) and ``RssFile + RssShmem``
(mapped files) apart; sampling can miss a spike shorter than its interval. Then it
reads the per-layer timings the stage writes, the ``"stream"`` key of
``OUT/activation/powerinfer_stats.json`` and of ``OUT/predictor/config.json``::

    "stream": {"layer_seconds": [...], "n_tokens": int, "device": str, "dtype": str, "threads": int}

and, for the predictor, ``layers[i]["train_seconds"]`` and ``layers[i]["epochs"]``; what
is missing prints as ``n/a``. The summary gives per stage: wall s, CPU s, peak RSS
GiB, calibration tokens, mean seconds per layer, tokens/s per layer (n_tokens / mean
layer seconds: compare with ``bench_gemm.py``'s bound) and, for predictor training,
the mean training seconds per layer per epoch.

Both stages reuse their work folders on re-runs (pi-train-predictor skips finished
layers), which would time nothing: OUT/profile-work and OUT/predictor-work are
therefore deleted before their stage unless ``--reuse``, and a run claims OUT with
``OUT/.bench_calibration.pid`` (a second run on the same OUT is refused). Timings need the cores to
themselves (see benchmarks/README.md); the load average is printed before each stage.
``tests/data/text/wiki.test.raw`` is the WikiText-2 raw test split, bundled with the
repository (source, licence and sha256 in ``tests/data/README.md``).

    python benchmarks/bench_calibration.py out/full7b --data tests/data/text/wiki.test.raw \\
        --max-tokens 2048 --heldout-tokens 512 --epochs 3 --threads 2 --out out/calib-7b --json out/calib-7b/bench.json
    python benchmarks/bench_calibration.py powerinfer/assets/stories260K-relu \\
        --data powerinfer/assets/calibration.txt --max-tokens 2048        # a smoke run
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

STAGES = {"profile": "pi-profile", "predictor": "pi-train-predictor"}


def cli(name: str) -> list[str]:
    """The command for an entry point: the script beside this interpreter, else on PATH."""
    beside = Path(sys.executable).parent / name
    if beside.is_file():
        return [str(beside)]
    found = shutil.which(name)
    if found:
        return [found]
    raise SystemExit(f"{name}: not found (pip install -e . into this interpreter)")


def cli_flags(cmd: list[str]) -> str:
    """The CLI's ``--help`` text, to check which options it has."""
    r = subprocess.run(cmd + ["--help"], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} --help failed:\n{r.stderr}")
    return r.stdout


def with_optional(cmd: list[str], help_text: str, optional: dict[str, object | None], stage: str) -> list[str]:
    """Append ``--flag value`` for each given value whose flag the CLI knows; note the others."""
    for flag, value in optional.items():
        if value is None:
            continue
        if re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_text):
            cmd += [flag, str(value)]
        else:
            print(f"note: {stage}: this {Path(cmd[0]).name} has no {flag}; not passed", flush=True)
    return cmd


class RssSampler(threading.Thread):
    """Peaks of a process's anonymous and file-backed resident memory, sampled from
    ``/proc/PID/status`` (``RssAnon``, ``RssFile`` + ``RssShmem``) every ``interval`` seconds.

    ``ru_maxrss`` is exact but counts the pages of memory-mapped files (safetensors shards
    read through ``safe_open``) like allocated memory; those are page cache the kernel can
    drop, so the split tells a real footprint from a mapped checkpoint."""

    def __init__(self, pid: int, interval: float = 0.1):
        super().__init__(daemon=True)
        self.path = Path(f"/proc/{pid}/status")
        self.interval = interval
        self.peak = {"anon": 0, "file": 0}  # KiB
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                kv = dict(ln.split(":", 1) for ln in self.path.read_text().splitlines() if ":" in ln)
            except OSError:  # gone, or not Linux
                return
            kib = {k: int(v.split()[0]) for k, v in kv.items() if k.startswith("Rss")}
            if "RssAnon" in kib:
                self.peak["anon"] = max(self.peak["anon"], kib["RssAnon"])
                self.peak["file"] = max(self.peak["file"], kib.get("RssFile", 0) + kib.get("RssShmem", 0))
            self.stop.wait(self.interval)


def run_child(cmd: list[str]) -> dict:
    """Run ``cmd`` with inherited stdio; its wall time, CPU time, peak RSS and exit code."""
    print("$ " + " ".join(shlex.quote(c) for c in cmd), flush=True)
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd)
    sampler = RssSampler(p.pid)
    sampler.start()
    try:
        _, status, ru = os.wait4(p.pid, 0)
    except KeyboardInterrupt:
        p.terminate()
        p.wait()
        raise
    finally:
        sampler.stop.set()
    wall = time.perf_counter() - t0
    sampler.join()
    p.returncode = os.waitstatus_to_exitcode(status)  # reaped here: keep Popen from waiting again
    return {"cmd": cmd, "rc": p.returncode, "wall_s": wall, "cpu_s": ru.ru_utime + ru.ru_stime,
            "peak_rss_gib": ru.ru_maxrss / 2**20,  # ru_maxrss: KiB on Linux
            "peak_anon_gib": sampler.peak["anon"] / 2**20, "peak_file_gib": sampler.peak["file"] / 2**20}


def read_json(path: Path) -> dict:
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return d if isinstance(d, dict) else {}


def layer_stats(doc: dict) -> dict:
    """Per-layer figures from a stage's JSON (``"stream"`` and predictor ``layers``); None where absent."""
    s = doc.get("stream") if isinstance(doc.get("stream"), dict) else {}
    secs = [float(x) for x in s.get("layer_seconds") or [] if isinstance(x, (int, float))]
    n_tokens = s.get("n_tokens")
    mean = sum(secs) / len(secs) if secs else None
    out = {"n_tokens": n_tokens, "n_layers": len(secs) or None, "mean_layer_s": mean,
           "tokens_per_s_per_layer": n_tokens / mean if mean and isinstance(n_tokens, (int, float)) else None,
           "device": s.get("device"), "dtype": s.get("dtype"), "threads": s.get("threads"),
           "layer_seconds": secs or None, "train_s_per_layer_epoch": None}
    layers = doc.get("layers")
    if isinstance(layers, list):
        per = [float(l["train_seconds"]) / l["epochs"] for l in layers
               if isinstance(l, dict) and isinstance(l.get("train_seconds"), (int, float))
               and isinstance(l.get("epochs"), int) and l["epochs"] > 0]
        if per:
            out["train_s_per_layer_epoch"] = sum(per) / len(per)
    return out


def fmt(x, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def print_summary(results: dict[str, dict]) -> None:
    cols = (f"{'stage':<10}{'rc':>4}{'wall s':>9}{'cpu s':>9}{'peak GiB':>10}{'anon':>7}{'file':>7}{'tokens':>9}"
            f"{'s/layer':>10}{'tok/s/layer':>13}{'train s/layer/epoch':>21}  device/dtype/threads")
    print("\n" + cols)
    print("-" * len(cols))
    for stage, r in results.items():
        s = r["stats"]
        where = "/".join(str(s[k]) if s[k] is not None else "n/a" for k in ("device", "dtype", "threads"))
        print(f"{stage:<10}{r['rc']:>4}{r['wall_s']:>9.1f}{r['cpu_s']:>9.1f}{r['peak_rss_gib']:>10.2f}"
              f"{r['peak_anon_gib']:>7.2f}{r['peak_file_gib']:>7.2f}"
              f"{fmt(s['n_tokens'], 'd'):>9}{fmt(s['mean_layer_s'], '.3f'):>10}"
              f"{fmt(s['tokens_per_s_per_layer'], '.0f'):>13}{fmt(s['train_s_per_layer_epoch'], '.3f'):>21}  {where}")
    print("peak GiB: the child's ru_maxrss (exact; counts touched pages of memory-mapped files); anon / file: "
          "peaks of its RssAnon and RssFile+RssShmem sampled every 0.1 s (file pages are droppable page cache)")


def lock_out(out: Path) -> Path:
    """Claim OUT for this run (``OUT/.bench_calibration.pid``): two runs on one OUT would delete
    each other's work folders. A lock left by a process that is gone is taken over."""
    lock = out / ".bench_calibration.pid"
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                pid = int(lock.read_text().strip() or 0)
                os.kill(pid, 0)
            except (ValueError, ProcessLookupError, FileNotFoundError):
                lock.unlink(missing_ok=True)  # stale
                continue
            except PermissionError:
                pass  # alive, another user's
            raise SystemExit(f"{out}: in use by another bench_calibration run (pid {pid}); use another --out")
        os.write(fd, f"{os.getpid()}\n".encode())
        os.close(fd)
        return lock
    raise SystemExit(f"{lock}: could not claim it")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir", type=Path, help="HF model folder (e.g. out/full7b from make_full_7b.py)")
    ap.add_argument("--data", required=True, help="calibration text, passed to both stages")
    ap.add_argument("--max-tokens", type=int, default=4096, help="calibration tokens per stage (default 4096)")
    ap.add_argument("--heldout-tokens", type=int, help="predictor held-out tokens (default max-tokens / 4)")
    ap.add_argument("--epochs", type=int, default=3, help="predictor epochs per layer (default 3)")
    ap.add_argument("--threads", type=int, help="passed through when given")
    ap.add_argument("--device", help="passed through when given (and the CLI has it)")
    ap.add_argument("--dtype", help="passed through when given (and the CLI has it)")
    ap.add_argument("--out", type=Path, default=Path("out/bench-calibration"), help="default out/bench-calibration")
    ap.add_argument("--profile-args", default="", help="extra pi-profile arguments (one shell-quoted string)")
    ap.add_argument("--predictor-args", default="", help="extra pi-train-predictor arguments")
    ap.add_argument("--skip-profile", action="store_true")
    ap.add_argument("--skip-predictor", action="store_true")
    ap.add_argument("--reuse", action="store_true", help="keep the work folders of earlier runs")
    ap.add_argument("--json", type=Path, help="write the figures here")
    a = ap.parse_args(argv)
    heldout = a.heldout_tokens or max(2, a.max_tokens // 4)
    a.out.mkdir(parents=True, exist_ok=True)
    common = {"--threads": a.threads, "--device": a.device, "--dtype": a.dtype}

    plans: dict[str, tuple[list[str], Path, Path]] = {}  # stage -> (command, work dir, JSON to read)
    if not a.skip_profile:
        cmd = cli(STAGES["profile"])
        cmd = with_optional(cmd + [str(a.model_dir), "--data", a.data, "--out", str(a.out / "activation"),
                                   "--max-tokens", str(a.max_tokens)],
                            cli_flags(cmd), {"--work-dir": a.out / "profile-work", **common}, "profile")
        plans["profile"] = (cmd + shlex.split(a.profile_args), a.out / "profile-work",
                            a.out / "activation" / "powerinfer_stats.json")
    if not a.skip_predictor:
        cmd = cli(STAGES["predictor"])
        cmd = with_optional(cmd + [str(a.model_dir), "--data", a.data, "--out", str(a.out / "predictor"),
                                   "--work-dir", str(a.out / "predictor-work"), "--max-tokens", str(a.max_tokens),
                                   "--heldout-tokens", str(heldout), "--epochs", str(a.epochs)],
                            cli_flags(cmd), common, "predictor")
        plans["predictor"] = (cmd + shlex.split(a.predictor_args), a.out / "predictor-work",
                              a.out / "predictor" / "config.json")

    lock = lock_out(a.out)
    try:
        results = run_stages(plans, a.reuse)
    finally:
        lock.unlink(missing_ok=True)
    if results:
        print_summary(results)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"model_dir": str(a.model_dir), "data": a.data, "max_tokens": a.max_tokens,
                                      "heldout_tokens": heldout, "epochs": a.epochs, "stages": results},
                                     indent=1) + "\n")
        print(f"wrote {a.json}")
    if any(r["rc"] != 0 for r in results.values()):
        sys.exit(1)


def run_stages(plans: dict[str, tuple[list[str], Path, Path]], reuse: bool) -> dict[str, dict]:
    """Run each planned stage (fresh work folder unless ``reuse``) until one fails."""
    results: dict[str, dict] = {}
    for stage, (cmd, work, stats_file) in plans.items():
        print(f"\n== {stage}: load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
        if work.exists() and not reuse:
            print(f"removing {work} (a re-run would reuse it; --reuse keeps it)", flush=True)
            shutil.rmtree(work)
        stats_file.unlink(missing_ok=True)  # never read an earlier run's figures
        r = run_child(cmd)
        r["stats"] = layer_stats(read_json(stats_file)) if r["rc"] == 0 else layer_stats({})
        r["loadavg_after"] = os.getloadavg()
        results[stage] = r
        print(f"== {stage}: exit {r['rc']}, {r['wall_s']:.1f} s wall, {r['cpu_s']:.1f} s CPU, peak RSS "
              f"{r['peak_rss_gib']:.2f} GiB (anon {r['peak_anon_gib']:.2f}, file {r['peak_file_gib']:.2f})",
              flush=True)
        if r["rc"] != 0:
            break
    return results


if __name__ == "__main__":
    main()
