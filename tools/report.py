"""`asyncrl report RUN_DIR`: one static HTML page about a run, RUN_DIR/report.html.

```
  metrics.jsonl ──> curves: reward, throughput, staleness, ESS, mismatch KL, entropy, length
  eval.jsonl    ──> curve: held-out reward and pass@1 by policy version
  alarms.jsonl  ──> table, and a red marker at each alarm's step on every curve
  trajectories/ ──> the worst and best kept trajectories, token by token (colour: IS weight)
  summary.json, config.toml ──> the header
                                   └──> report.html (inline SVG and CSS: opens from disk)
```

Everything is inside the one file (no scripts, no fonts, no images to fetch), so it opens in any
browser without a server and can be mailed or attached to a ticket.
"""

from __future__ import annotations

import argparse
import html
import json
import math
import tomllib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from asyncrl.evaluation import read_evals
from learner.alarms import read_alarms
from learner.metrics_log import read_metrics
from learner.trajectory_store import Table, load_table
from tools.charts import Series, line_chart, smooth
from tools.inspect import decoder, turns

NUM_SHOWN = 3  # worst and best trajectories shown
CSS = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #222; max-width: 1120px; }
h1 { font-size: 22px; } h2 { font-size: 17px; margin-top: 28px; }
.charts { display: flex; flex-wrap: wrap; gap: 8px; }
svg.chart { background: #fafafa; border: 1px solid #ddd; font-size: 11px; }
svg .title { font-size: 13px; font-weight: 600; } svg .grid { stroke: #e4e4e4; }
svg .mark { stroke: #d62728; stroke-dasharray: 3 3; }
table { border-collapse: collapse; } td, th { border: 1px solid #ddd; padding: 3px 8px; }
.trajectory { border: 1px solid #ccc; margin: 10px 0; padding: 8px; background: #fcfcfc; }
.tok { font-family: ui-monospace, monospace; padding: 1px 2px; margin: 0 1px; border-radius: 3px; }
.env { outline: 1px dashed #888; } .meta { color: #555; font-size: 12px; }
"""


def load_run(run_dir: Path) -> dict[str, Any]:
    """Everything the report shows, read from the run directory."""
    config_path = run_dir / "config.toml"
    summary_path = run_dir / "summary.json"
    alarms_path = run_dir / "alarms.jsonl"
    try:
        table: Table | None = load_table(run_dir)
    except ValueError:
        table = None
    return {
        "metrics": read_metrics(run_dir / "metrics.jsonl"),
        "evals": [e for e in read_evals(run_dir) if e.get("source") != "offline"],
        "alarms": read_alarms(alarms_path),
        "config": tomllib.loads(config_path.read_text()) if config_path.is_file() else {},
        "summary": json.loads(summary_path.read_text()) if summary_path.is_file() else {},
        "table": table,
    }


def column(rows: Sequence[dict[str, Any]], key: str) -> list[float]:
    out = []
    for r in rows:
        v = r.get(key)
        out.append(float(v) if isinstance(v, int | float) and not isinstance(v, bool) else math.nan)
    return out


def curves(run: dict[str, Any]) -> list[str]:
    """The SVG charts of the run's step metrics and evaluations."""
    rows, marks = run["metrics"], [a["step"] for a in run["alarms"]]
    steps = column(rows, "step")
    k = max(1, len(rows) // 50)

    def chart(cid: str, title: str, keys: Sequence[tuple[str, str]], raw: bool = False) -> str:
        series = []
        for key, label in keys:
            ys = column(rows, key)
            if raw:
                series.append(Series(f"{label} (per step)", steps, ys, faint=True))
            series.append(
                Series(label if k == 1 else f"{label} (mean of {k})", steps, smooth(ys, k))
            )
        return line_chart(cid, title, series, marks=marks)

    charts = [
        chart("chart-reward", "reward", [("reward_mean", "mean reward")], raw=True),
        chart("chart-throughput", "throughput (samples/s)", [("samples_per_s", "samples/s")]),
        chart(
            "chart-staleness",
            "staleness (versions)",
            [("staleness_mean", "mean"), ("staleness_max", "max")],
        ),
        chart("chart-ess", "effective sample size (fraction)", [("ess", "ESS")], raw=True),
        chart("chart-kl", "mismatch KL (learner vs behaviour)", [("mismatch_kl", "KL")], raw=True),
        chart("chart-entropy", "entropy (nats/token)", [("entropy", "entropy")]),
        chart("chart-length", "response length (tokens)", [("response_len_mean", "mean length")]),
    ]
    evals = sorted(run["evals"], key=lambda e: e.get("policy_version", 0))
    versions = column(evals, "policy_version")
    n = int(evals[-1].get("num_samples", 1)) if evals else 1
    eval_series = [
        Series("held-out reward", versions, column(evals, "reward_mean")),
        Series("pass@1", versions, column(evals, "pass@1")),
    ]
    if n > 1:
        eval_series.append(Series(f"pass@{n}", versions, column(evals, f"pass@{n}")))
    charts.append(
        line_chart(
            "chart-eval",
            "evaluation (held-out prompts)",
            eval_series,
            x_label="policy version",
            marks=marks,
        )
    )
    return charts


def alarm_table(alarms: Sequence[dict[str, Any]]) -> str:
    if not alarms:
        return '<p id="alarms-none">No alarm fired.</p>'
    rows = "".join(
        f"<tr><td>{a['step']}</td><td>{a['policy_version']}</td><td>{html.escape(a['name'])}</td>"
        f"<td>{html.escape(a.get('action', 'warn'))}</td><td>{html.escape(a['message'])}</td></tr>"
        for a in alarms
    )
    return (
        f'<table id="alarms"><tr><th>step</th><th>version</th><th>alarm</th><th>action</th>'
        f"<th>evidence</th></tr>{rows}</table>"
    )


def weight_color(weight: float) -> str:
    """Background of a token by its IS weight: white at 1, blue below, red above (log scale)."""
    if not math.isfinite(weight):
        return "#eeeeee"
    x = max(-1.0, min(1.0, math.log(max(weight, 1e-9)) / math.log(4)))
    fade = int(255 - 150 * abs(x))
    return f"#{255:02x}{fade:02x}{fade:02x}" if x > 0 else f"#{fade:02x}{fade:02x}{255:02x}"


def trajectory_html(
    record: dict[str, Any], decode: Callable[[Sequence[int]], str], label: str
) -> str:
    """One trajectory: its facts, its prompt, then every completion token with its numbers."""
    r = record
    comps = ", ".join(f"{k} {v:.4g}" for k, v in r.get("components", {}).items())
    facts = (
        f"{label}: reward <b>{r['reward']:.4g}</b>{' (' + comps + ')' if comps else ''}, "
        f"advantage {r['advantage']:.3g}, finish {r['finish_reason']}, versions "
        f"{r['min_version']}..{r['max_version']}, staleness {r['staleness']}, step "
        f"{r['step']}, actor {r['actor_id']}, kept as {r['reason']}"
    )
    plen, tokens = r["prompt_len"], r["tokens"]
    spans = []
    for who, a, b in turns(r):
        for k in range(a, b):
            lp, mu = float(r["learner_logprobs"][k]), float(r["behavior_logprobs"][k])
            if who == "model":
                w = math.exp(lp - mu) if math.isfinite(lp) else math.nan
                tip = f"behaviour lp {mu:.4f}, learner lp {lp:.4f}, IS weight {w:.4f}, mask 1"
            else:  # inserted by the environment: not sampled, no behaviour logprob
                w, tip = math.nan, f"environment token, learner lp {lp:.4f}, mask 0"
            cls = "tok" if who == "model" else "tok env"
            text = html.escape(decode([tokens[plen + k]]))
            spans.append(
                f'<span class="{cls}" style="background:{weight_color(w)}" '
                f'title="{tip}">{text}</span>'
            )
    return (
        f'<div class="trajectory" data-reward="{r["reward"]:.6g}" '
        f'data-id="{html.escape(r["trajectory_id"])}"><div class="meta">{facts}</div>'
        f"<div><b>prompt</b> <code>{html.escape(decode(tokens[:plen]))}</code></div>"
        f"<div><b>completion</b> {''.join(spans)}</div></div>"
    )


def trajectories_html(table: Table | None, run_dir: Path) -> str:
    if table is None or not len(table):
        return '<p id="trajectories-none">No trajectories were kept.</p>'
    order = np.argsort(table["reward"], kind="stable")
    worst, best = order[:NUM_SHOWN], order[::-1][:NUM_SHOWN]
    decode = decoder(run_dir)
    parts = [
        '<p class="meta">Token colour: IS weight π/μ (blue below 1, red above); hover a '
        "token for its log-probs. Dashed: inserted by the environment (mask 0).</p>"
    ]
    parts += [trajectory_html(table.record(int(i)), decode, "worst") for i in worst]
    parts += [trajectory_html(table.record(int(i)), decode, "best") for i in best]
    return f'<section id="trajectories">{"".join(parts)}</section>'


def header(run: dict[str, Any], run_dir: Path) -> str:
    cfg, summary = run["config"], run["summary"]
    get = lambda section, key: cfg.get(section, {}).get(key, "?")  # noqa: E731
    facts = [
        f"task {get('task', 'name')}",
        f"loss {get('loss', 'name')}",
        f"η = {get('replay', 'max_staleness')}",
        f"{len(run['metrics'])} steps",
    ]
    if summary.get("steps"):
        facts += [
            f"reward {summary['reward_first_tenth']:.3f} → {summary['reward_last_tenth']:.3f}"
            " (first → last tenth)",
            f"{summary['samples_per_s']:.0f} samples/s",
        ]
    facts += [f"{len(run['alarms'])} alarms", f"{len(run['evals'])} evaluations"]
    return f"<h1>asyncrl run {html.escape(str(run_dir))}</h1><p>{' · '.join(facts)}</p>"


def render(run_dir: Path) -> str:
    """The whole report as one HTML document."""
    run = load_run(run_dir)
    return (
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>asyncrl report "
        f"{html.escape(run_dir.name)}</title><style>{CSS}</style></head><body>"
        f"{header(run, run_dir)}<h2>Curves</h2><div class='charts'>{''.join(curves(run))}"
        f"</div><h2>Alarms</h2>{alarm_table(run['alarms'])}"
        f"<h2>Worst and best kept trajectories</h2>{trajectories_html(run['table'], run_dir)}"
        f"</body></html>"
    )


def main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="asyncrl report", description="Write RUN_DIR/report.html.")
    p.add_argument("run_dir", help="run directory")
    p.add_argument("--out", default="", help="output file (default RUN_DIR/report.html)")
    args = p.parse_args(list(argv))
    run_dir = Path(args.run_dir)
    if not (run_dir / "metrics.jsonl").is_file():
        raise ValueError(f"{run_dir}: no metrics.jsonl (not a run directory?)")
    out = Path(args.out) if args.out else run_dir / "report.html"
    out.write_text(render(run_dir), encoding="utf-8")
    print(f"asyncrl report: wrote {out}")
    return 0
