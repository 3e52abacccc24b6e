"""The study's page: what a browser gets at ``GET /studies/{study}``.

One self-contained HTML document (no file or script from elsewhere: the service may run where
nothing else can be reached): the study's progress (trials done of the spec's, running, the
estimated time to finish), its target and budget, the front as a picture, a box to type a
budget and see the plan that ``best`` returns for it, and the plans on the front layer by
layer. The box asks the service itself (``GET /studies/{study}/best?budget=``) and shows that
answer as it is, or its one-line 404 or 422. Everything interpolated is escaped; the data the
script reads is JSON in a ``<script type="application/json">`` block.
"""

from __future__ import annotations

import html
import json
import urllib.parse
from collections.abc import Callable

from remat_search.errors import SpecError
from remat_search.report import pictures
from remat_search.report.queries import StudySummary
from remat_search.report.results import StudyReport
from remat_search.report.text import eta_text, fastest_text, progress_text
from remat_search.units import format_bytes, size_argument


def render_page(summary: StudySummary, report: StudyReport) -> str:
    """The page of the study that ``summary`` and ``report`` describe."""
    e = html.escape
    base = "/studies/" + urllib.parse.quote(summary.study, safe="")
    budget = size_argument(summary.budget) if summary.budget else ""
    share = summary.done / summary.total if summary.total else 1.0 if summary.done else 0.0
    fastest = (
        f"{fastest_text(summary)}<small>trial {summary.fastest_trial}</small>"
        if summary.fastest_seconds is not None and summary.fastest_trial is not None else "—"
    )
    data = {"base": base, "budget": budget, "total": summary.total, "done": summary.done}
    bar = f"<div class='bar'><span style='width:{share:.1%}'></span></div>"
    stats = [
        ("progress", "trials done", e(progress_text(summary)) + bar),
        ("running", "running now", str(summary.running)),
        ("eta", "estimated time to finish", e(eta_text(summary))),
        ("fastest", "fastest step so far", fastest),
    ]
    cards = "".join(
        f"<div class='stat' id='{key}'><div class='label'>{e(label)}</div><div class='value'>{value}</div></div>"
        for key, label, value in stats
    )
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{e(summary.study)} · remat-search</title>
<style>{_STYLE}</style>
</head>
<body>
<header><div class="wrap">
  <div class="brand">remat-search</div>
  <h1>{e(summary.study)}</h1>
  <p class="meta"><span>target <b>{e(summary.target)}</b></span><span>device <b>{e(summary.device)}</b></span>
  <span>budget <b>{e(format_bytes(summary.budget)) if summary.budget else "—"}</b> per device</span>
  <span>{summary.complete} complete · {summary.failed} failed</span></p>
</div></header>
<main>
<section class="stats">{cards}</section>
<section class="grid">
  <div class="pictures">
  <figure class="card" id="front">
    <figcaption>Step time against compiled peak memory</figcaption>
    {_picture(_front_svg, report)}
  </figure>
  <figure class="card" id="layers">
    <figcaption>The plans on the front, layer by layer</figcaption>
    {_picture(_layers_svg, report)}
  </figure>
  </div>
  <aside class="card" id="ask">
    <h2>Best plan for a budget</h2>
    <p class="hint">The fastest measured plan whose compiled peak fits: what <code>remat-search best</code>
    answers, from <code>GET {e(base)}/best?budget=</code>.</p>
    <form id="ask-form" autocomplete="off">
      <input id="budget" name="budget" value="{e(budget)}" placeholder="e.g. 14GiB" aria-label="budget"
             spellcheck="false">
      <button id="ask-button" type="submit">Find plan</button>
    </form>
    <div id="answer" aria-live="polite"><p class="hint">Type a budget (14GiB, 200MiB, 1.6e10) and press Find plan.</p>
    </div>
  </aside>
</section>
</main>
<footer>JSON: <a href="{e(base)}">{e(base)}</a> · <a href="{e(base)}/pareto">{e(base)}/pareto</a> ·
<a href="/studies">/studies</a> · API: <a href="/docs">/docs</a></footer>
<script type="application/json" id="study-data">{_json_for_script(data)}</script>
<script>{_SCRIPT}</script>
</body>
</html>
"""


def _picture(draw: Callable[[StudyReport], str], report: StudyReport) -> str:
    """A picture's SVG, or the line that says why it cannot be drawn here (no matplotlib)."""
    try:
        pictures.require()
    except SpecError:
        return (
            "<p class='missing'>the pictures need matplotlib, which is not installed: "
            "pip install 'remat-search[service]'</p>"
        )
    return draw(report)


def _front_svg(report: StudyReport) -> str:
    return pictures.front_svg(report, budget=report.budget)


def _layers_svg(report: StudyReport) -> str:
    return pictures.layers_svg(report)


def _json_for_script(data: object) -> str:
    """JSON that cannot end its ``<script>`` block early: ``<``, ``>`` and ``&`` escaped."""
    return json.dumps(data).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


_STYLE = """
:root{--ink:#1d2330;--muted:#5f6b7a;--line:#e3e7ee;--bg:#f5f7fa;--accent:#2f6fde;--bad:#b42318;--good:#1a7f37}
*{box-sizing:border-box}
body{margin:0;background:var(--bg);color:var(--ink);font:15px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,
"Helvetica Neue",Arial,sans-serif}
header{background:#fff;border-bottom:1px solid var(--line);padding:18px 32px 14px}
header .wrap{max-width:1256px;margin:0 auto}
.brand{font-size:12px;letter-spacing:.08em;text-transform:uppercase;color:var(--muted)}
h1{margin:2px 0 6px;font-size:26px;font-weight:650}
.meta{margin:0;color:var(--muted);display:flex;flex-wrap:wrap;gap:6px 22px}.meta b{color:var(--ink);font-weight:600}
main{max-width:1320px;margin:0 auto;padding:22px 32px}
.stats{display:grid;grid-template-columns:repeat(4,1fr);gap:14px;margin-bottom:18px}
.stat,.card{background:#fff;border:1px solid var(--line);border-radius:10px}
.stat{padding:12px 16px}
.stat .label{font-size:12px;color:var(--muted);text-transform:uppercase;letter-spacing:.05em}
.stat .value{font-size:22px;font-weight:650;margin-top:2px;font-variant-numeric:tabular-nums}
.stat small{font-size:13px;font-weight:400;color:var(--muted);margin-left:8px}
.bar{height:6px;background:var(--line);border-radius:3px;margin-top:8px;overflow:hidden}
.bar span{display:block;height:100%;background:var(--accent)}
.grid{display:grid;grid-template-columns:minmax(0,1fr) 380px;gap:18px;align-items:start}
.pictures{display:grid;gap:18px;min-width:0}
#ask{position:sticky;top:16px}
.card{margin:0;padding:16px 18px}
figcaption,h2{font-size:15px;font-weight:650;margin:0 0 10px}
figure svg{max-width:100%;height:auto;display:block;margin:0 auto}
.hint{color:var(--muted);font-size:13px;margin:0 0 12px}
code{font:12.5px ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;background:#f0f2f6;padding:1px 4px;
border-radius:4px}
form{display:flex;gap:8px;margin-bottom:14px}
input{flex:1;min-width:0;font:inherit;font-size:16px;padding:8px 10px;border:1px solid #c9d0db;border-radius:7px}
input:focus{outline:2px solid #b9cff7;border-color:var(--accent)}
button{font:inherit;font-weight:600;padding:8px 16px;border:0;border-radius:7px;background:var(--accent);
color:#fff;cursor:pointer}
button:hover{background:#2259bd}
.facts{display:grid;grid-template-columns:auto 1fr;gap:4px 14px;margin:0 0 12px}
.facts dt{color:var(--muted)}.facts dd{margin:0;font-weight:600;font-variant-numeric:tabular-nums}
table{border-collapse:collapse;width:100%;margin-bottom:12px;font-size:14px}
th,td{text-align:left;padding:5px 8px;border-bottom:1px solid var(--line)}
th{font-size:12px;color:var(--muted);font-weight:600;text-transform:uppercase;letter-spacing:.04em}
td.n{width:3em;color:var(--muted);font-variant-numeric:tabular-nums}
pre{white-space:pre-wrap;word-break:break-all;background:#f0f2f6;border-radius:7px;padding:10px;margin:0 0 6px;
font:12px ui-monospace,SFMono-Regular,Menlo,Consolas,monospace}
.ok{color:var(--good);font-weight:650;margin:0 0 8px}
.error{color:var(--bad);background:#fef3f2;border:1px solid #fecdca;border-radius:7px;padding:10px 12px;margin:0}
.missing{color:var(--muted)}
footer{max-width:1320px;margin:0 auto;padding:4px 32px 28px;color:var(--muted);font-size:13px}
a{color:var(--accent)}
@media (max-width:1000px){.grid{grid-template-columns:1fr}#ask{position:static}.stats{grid-template-columns:repeat(2,1fr)}}
"""

_SCRIPT = """
(function () {
  "use strict";
  const data = JSON.parse(document.getElementById("study-data").textContent);
  const answer = document.getElementById("answer");
  const el = (tag, attrs, ...children) => {
    const node = document.createElement(tag);
    Object.entries(attrs || {}).forEach(([k, v]) => node.setAttribute(k, v));
    children.forEach((c) => node.append(c));
    return node;
  };
  const bytes = (n) => {
    const units = ["B", "KiB", "MiB", "GiB"];
    let i = 0;
    while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
    return i === 0 ? n.toFixed(0) + " B" : n.toFixed(1) + " " + units[i];
  };
  const seconds = (s) => {  // as units.format_seconds: three significant digits, ms below a second
    const [v, unit] = s < 1 ? [s * 1e3, " ms"] : [s, " s"];
    return v.toFixed(v > 0 && isFinite(v) ? Math.max(0, 2 - Math.floor(Math.log10(v))) : 2) + unit;
  };
  const duration = (s) => {  // units.format_duration
    s = Math.max(0, Math.round(s));
    if (s < 60) return s + " s";
    const m = Math.round(s / 60);
    if (m < 60) return m + " min";
    if (m < 24 * 60) return Math.floor(m / 60) + " h " + String(m % 60).padStart(2, "0") + " min";
    const h = Math.round(s / 3600);
    return Math.floor(h / 24) + " d " + (h % 24) + " h";
  };
  const policy = (p) => p.kind + (p.function ? ": " + p.function : "")  // policy.LayerPolicy.__str__
    + (p.names && p.names.length ? ": " + p.names.join(", ") : "")
    + (p.offload && p.offload.length ? (p.names && p.names.length ? "; " : ": ") + "offload " + p.offload.join(", ") : "");

  async function ask(budget) {
    const url = data.base + "/best?budget=" + encodeURIComponent(budget);
    answer.replaceChildren(el("p", {class: "hint"}, "asking " + url + " …"));
    let response, text;
    try {
      response = await fetch(url, {headers: {Accept: "application/json"}});
      text = await response.text();
    } catch (err) {
      answer.replaceChildren(el("p", {class: "error", id: "answer-error"}, "the service did not answer: " + err));
      return;
    }
    if (!response.ok) {
      let detail = text;
      try { detail = JSON.parse(text).detail; } catch (err) { /* not JSON: shown as it came */ }
      answer.replaceChildren(el("p", {class: "error", id: "answer-error"}, response.status + ": " + detail));
      return;
    }
    const plan = JSON.parse(text);
    const trial = response.headers.get("X-Remat-Search-Trial");
    const peak = Number(response.headers.get("X-Remat-Search-Peak-Bytes"));
    const step = Number(response.headers.get("X-Remat-Search-Seconds"));
    const source = response.headers.get("X-Remat-Search-Time-Source");
    const mark = response.headers.get("X-Remat-Search-Estimate") || "estimated";
    const within = response.headers.get("X-Remat-Search-Within-Error");
    let labels = [];
    try {
      const t = await (await fetch(data.base + "/trials/" + encodeURIComponent(trial))).json();
      labels = t.labels || [];
    } catch (err) { /* the labels are a nicety: the plan itself is shown */ }
    const facts = el("dl", {class: "facts"},
      el("dt", {}, "trial"), el("dd", {id: "answer-trial"}, trial),
      el("dt", {}, "step time"), el("dd", {id: "answer-step"},
        seconds(step) + (source === "confirmed" ? " ✓ confirmed" : source === "estimated" ? " (" + mark + ")" : "")),
      el("dt", {}, "compiled peak"), el("dd", {id: "answer-peak"}, bytes(peak)));
    const rows = plan.layers.map((p, i) => el("tr", {},
      el("td", {class: "n"}, String(i)),
      el("td", {}, labels.length === plan.layers.length && labels[i] !== policy(p) ? labels[i] + " = " + policy(p)
                                                                                 : policy(p))));
    const table = el("table", {id: "answer-layers"},
      el("thead", {}, el("tr", {}, el("th", {}, "layer"), el("th", {}, "policy"))), el("tbody", {}, ...rows));
    answer.replaceChildren(
      el("p", {class: "ok"}, "fits " + budget + (plan.layout === "nested" ? " (nested layout)" : "")),
      ...(within ? [el("p", {class: "error", id: "answer-within"}, "within the estimate's error of trial(s) " + within
                        + ": its band cannot tell which is faster; measure them on the chip")] : []),
      facts, table, el("pre", {id: "plan-json"}, text.trim()),
      el("p", {class: "hint"}, "the same from a shell:"),
      el("pre", {}, "curl '" + location.origin + url + "' > plan.json"));
  }

  document.getElementById("ask-form").addEventListener("submit", (event) => {
    event.preventDefault();
    ask(document.getElementById("budget").value.trim());
  });

  async function refresh() {  // a study being measured: its progress, every 15 s
    try {
      const s = await (await fetch(data.base, {headers: {Accept: "application/json"}})).json();
      const done = s.total === null ? String(s.done) : s.done + "/" + s.total;
      document.querySelector("#progress .value").firstChild.textContent = done;
      document.querySelector("#progress .bar span").style.width = (s.total ? 100 * s.done / s.total : 0) + "%";
      document.querySelector("#running .value").textContent = String(s.running);
      if (s.eta_seconds !== null) {
        document.querySelector("#eta .value").textContent = "~" + duration(s.eta_seconds);
      } else if (s.total !== null && s.done >= s.total) {
        document.querySelector("#eta .value").textContent = "finished";
        return;
      }
    } catch (err) { /* the next refresh tries again */ }
    setTimeout(refresh, 15000);
  }
  if (data.total === null || data.done < data.total) setTimeout(refresh, 15000);
})();
"""
