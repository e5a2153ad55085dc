/* Tidal dashboard: a page per hash route (#/pool, #/serving, #/jobs, #/job/<id>), refreshed by polling the
   read-only JSON API with the bearer token kept in sessionStorage. Every value from the server is put into
   the page as text (el() below), never as HTML. */
"use strict";

const TOKEN_KEY = "tidal.token";
const REFRESH_MS = 2000;
const PAGE = 50;
const STATES = [
  "pending",
  "admitted",
  "running",
  "resizing",
  "preempting",
  "cancelling",
  "backoff",
  "succeeded",
  "failed",
  "cancelled",
];
const KINDS = ["job", "draining", "lent", "warming", "serving", "free"];
const KIND_LABEL = {
  job: "a job",
  draining: "draining",
  lent: "lent, idle",
  warming: "warming up",
  serving: "serving",
  free: "free",
};

let me = null; // whoami
let current = null; // {name, refresh, charts}
let timer = null;
let busy = false;

// ---------------------------------------------------------------------------------------------- helpers
function el(tag, attrs, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") e.className = v;
    else if (k === "on") for (const [ev, f] of Object.entries(v)) e.addEventListener(ev, f);
    else e.setAttribute(k, String(v));
  }
  for (const k of kids.flat()) {
    if (k === null || k === undefined || k === false) continue;
    e.append(k instanceof Node ? k : document.createTextNode(String(k)));
  }
  return e;
}
const $ = (id) => document.getElementById(id);
const num = (x, d = 0) => (x === null || x === undefined || !isFinite(x) ? "—" : Number(x).toFixed(d));
const pct = (x) => (x === null || x === undefined ? "—" : (100 * x).toFixed(1) + "%");
function ago(s) {
  if (s === null || s === undefined || !isFinite(s)) return "—";
  s = Math.max(0, s);
  if (s < 90) return s.toFixed(0) + " s";
  if (s < 5400) return (s / 60).toFixed(0) + " min";
  if (s < 172800) return (s / 3600).toFixed(1) + " h";
  return (s / 86400).toFixed(1) + " d";
}
function clock(t) {
  if (t === null || t === undefined) return "—";
  return new Date(t * 1000).toLocaleTimeString([], { hour12: false });
}
function dayTime(s) {
  // a serving-clock time as the time of day it stands for (a replayed trace's day)
  if (s === null || s === undefined || !isFinite(s)) return "—";
  const m = Math.floor((((s % 86400) + 86400) % 86400) / 60);
  return String(Math.floor(m / 60)).padStart(2, "0") + ":" + String(m % 60).padStart(2, "0");
}
const stateTag = (s) => el("span", { class: "state " + s }, s);
const jobLink = (id) =>
  id
    ? el("a", { href: "#/job/" + encodeURIComponent(id) }, id)
    : el("span", { class: "muted" }, "(another tenant's)");
function table(head, rows, numeric = []) {
  return el(
    "table",
    {},
    el(
      "thead",
      {},
      el(
        "tr",
        {},
        head.map((h, i) => el("th", { class: numeric.includes(i) ? "num" : null }, h)),
      ),
    ),
    el(
      "tbody",
      {},
      rows.map((r) =>
        el(
          "tr",
          {},
          r.map((c, i) =>
            el(
              "td",
              { class: numeric.includes(i) ? "num" : typeof c === "string" && c.length > 60 ? "wrap" : null },
              c,
            ),
          ),
        ),
      ),
    ),
  );
}
function stat(k, v) {
  return el("div", { class: "stat" }, el("div", { class: "v" }, v), el("div", { class: "k" }, k));
}

class Unauthorized extends Error {}
class NotFoundError extends Error {}

async function api(path) {
  const token = sessionStorage.getItem(TOKEN_KEY);
  const r = await fetch(path, { headers: { Authorization: "Bearer " + token }, cache: "no-store" });
  if (r.status === 401) throw new Unauthorized("the token was refused");
  if (r.status === 404) throw new NotFoundError((await r.json()).detail || "not found");
  if (!r.ok) throw new Error(path + ": HTTP " + r.status);
  return r.json();
}

// ---------------------------------------------------------------------------------------------- charts
function chart(holder, key, opts, data) {
  // one uPlot per (page, key); recreated when the series change, else only its data
  const width = Math.max(300, holder.clientWidth || 600);
  let c = current.charts[key];
  if (c && c.series.length === opts.series.length && c.root.isConnected) {
    c.setData(data);
    return c;
  }
  if (c) c.destroy();
  holder.replaceChildren();
  c = new uPlot({ width, height: 240, ...opts }, data, holder);
  current.charts[key] = c;
  return c;
}
const timeAxis = { scales: { x: { time: true } } };

// ---------------------------------------------------------------------------------------------- pages
function poolPage(root) {
  const gpuBox = el("div", { class: "card", id: "gpu-map" });
  const totals = el("div", { class: "cards", id: "pool-totals" });
  const tenants = el("div", { id: "tenants" });
  const queue = el("div", { id: "queue" });
  root.append(
    el("h1", {}, "Pool"),
    totals,
    gpuBox,
    el("h2", {}, "Tenants"),
    tenants,
    el("h2", {}, "Queue"),
    queue,
  );
  return async () => {
    const p = await api("/v1/dashboard/pool");
    const banner = document.getElementById("isolation-off");
    banner.textContent = p.warning || "";
    banner.hidden = !p.warning;
    totals.replaceChildren(
      stat("GPUs", p.gpus),
      ...KINDS.filter((k) => p.totals[k] || k === "free").map((k) => stat(KIND_LABEL[k], p.totals[k])),
      stat("running jobs", (p.states.running || 0) + (p.states.admitted || 0)),
      stat("waiting jobs", p.queue.total),
    );
    gpuBox.replaceChildren(
      el(
        "div",
        { class: "legend" },
        KINDS.map((k) => el("span", {}, el("i", { class: "gpu " + k }), KIND_LABEL[k])),
        el("span", {}, el("i", { class: "gpu other" }), "another tenant's job"),
      ),
      ...p.nodes.map((n) =>
        el(
          "div",
          { class: "node", "data-node": n.name },
          el("span", { class: "name", title: n.name }, n.name),
          el("span", { class: "pool" }, n.pool),
          el(
            "span",
            { class: "gpus" },
            n.segments.flatMap((s) =>
              Array.from({ length: s.gpus }, () =>
                el("i", {
                  class: "gpu " + (s.kind === "job" && !s.job ? "other" : s.kind),
                  "data-job": s.job,
                  title: gpuTitle(s),
                }),
              ),
            ),
          ),
          el("span", { class: "muted" }, `${n.used}/${n.gpus}`),
        ),
      ),
    );
    tenants.replaceChildren(
      p.tenants.length
        ? table(
            [
              "tenant",
              "dedicated GPUs / quota",
              "",
              "spot GPUs / fair share",
              "",
              "weight",
              "running",
              "waiting",
            ],
            p.tenants.map((t) => [
              t.tenant,
              `${t.dedicated_gpus} / ${t.quota_gpus}`,
              bar(t.dedicated_gpus, t.quota_gpus),
              `${t.spot_gpus} / ${t.fair_share_gpus === null ? "—" : t.fair_share_gpus}`,
              bar(t.spot_gpus, t.fair_share_gpus),
              num(t.weight, 2),
              t.running,
              t.waiting,
            ]),
            [5, 6, 7],
          )
        : el("p", { class: "muted" }, "No tenants yet."),
    );
    queue.replaceChildren(
      p.queue.total
        ? el(
            "div",
            {},
            table(
              ["#", "job", "tenant", "kind", "priority", "GPUs", "state", "waiting", "why it waits"],
              p.queue.jobs.map((q) => [
                q.position,
                jobLink(q.job),
                q.tenant,
                q.kind,
                q.priority,
                `${q.min_gpus}–${q.max_gpus}`,
                stateTag(q.state),
                ago(q.waiting_s),
                q.why,
              ]),
              [0, 4],
            ),
            p.queue.total > p.queue.shown
              ? el("p", { class: "muted" }, `${p.queue.total - p.queue.shown} more waiting`)
              : null,
          )
        : el("p", { class: "muted" }, "Nothing waits."),
    );
  };
}

function gpuTitle(s) {
  if (s.kind !== "job" && s.kind !== "draining") return KIND_LABEL[s.kind];
  const state = s.state ? ", " + s.state : "";
  return `${s.job || "a job"} (${s.tenant}${state})${s.kind === "draining" ? ", draining" : ""}`;
}

function bar(v, of) {
  if (of === null || of === undefined) return el("span", { class: "muted" }, "");
  const top = Math.max(v, of, 1);
  return el(
    "div",
    { class: "bar", title: `${v} of ${of}` },
    el("div", { style: `width:${((100 * v) / top).toFixed(1)}%` }),
    el("i", { style: `left:${((100 * of) / top).toFixed(1)}%` }),
  );
}

function servingPage(root) {
  const cards = el("div", { class: "cards", id: "serving-stats" });
  const engine = el("div", { class: "cards", id: "engine-stats" });
  const holder = el("div", { class: "chart", id: "loan-chart" });
  const info = el("div", { id: "serving-info" });
  root.append(el("h1", {}, "Serving & loans"), cards, engine, el("div", { class: "card" }, holder), info);
  let history = [];
  return async () => {
    const last = history.length ? history[history.length - 1].t : 0;
    const [s, p] = await Promise.all([
      api("/v1/dashboard/serving" + (last ? "?after=" + last : "")),
      api("/v1/dashboard/pool"),
    ]);
    engine.replaceChildren();
    if (!s.configured) {
      cards.replaceChildren();
      holder.replaceChildren(
        el(
          "p",
          { class: "muted" },
          "No serving side is configured (serving: in tidal up --config; docs/control.md).",
        ),
      );
      info.replaceChildren();
      return;
    }
    const v = s.view || {};
    if (!s.lending) {
      cards.replaceChildren(
        stat("lendable GPUs (advice)", num(v.lendable_gpus)),
        stat("demand", num(v.demand_gpus, 1)),
      );
      holder.replaceChildren(
        el(
          "p",
          { class: "muted" },
          "Advice only: the plane plans loans but does not lend " +
            "(serving.nodes not set). The timeline is drawn when it lends.",
        ),
      );
      info.replaceChildren(el("pre", {}, JSON.stringify(v, null, 1)));
      return;
    }
    history = history.concat(s.history).slice(-4000);
    const now = v.now_s;
    const reclaims = (v.reclaims || []).slice().sort((a, b) => a.by_s - b.by_s);
    const next = reclaims[0];
    const st = v.stats || {};
    cards.replaceChildren(
      stat("serving clock", dayTime(v.serving_time_s)),
      stat("serving GPUs", v.serving_gpus),
      stat("demand now", num(v.demand_gpus, 1)),
      stat("lent", v.lent_gpus),
      stat("warming up", v.warming_gpus),
      stat("serving capacity", v.serving_capacity_gpus),
      stat("next reclaim", next ? `${next.gpus} GPUs in ${ago(next.by_s - now)}` : "none"),
      stat("reclaims met / missed", `${num(st.reclaims_met)} / ${num(st.reclaims_missed)}`),
      stat("shortfall", st.demand_gpu_s ? pct(st.shortfall_gpu_s / st.demand_gpu_s) : "—"),
      stat("lent GPUs used", st.lent_gpu_s ? pct(st.used_gpu_s / st.lent_gpu_s) : "—"),
    );
    // a real engine's own figures beside demand (adapter llama.cpp), over its last window
    const e = v.engine;
    const ms = (x) => (x === null || x === undefined ? "—" : (1000 * x).toFixed(0) + " ms");
    engine.replaceChildren(
      ...(e
        ? [
            stat(`${e.engine}: TTFT p50 / p99`, `${ms(e.ttft_p50_s)} / ${ms(e.ttft_p99_s)}`),
            stat("requests running / waiting", `${num(e.running)} / ${num(e.waiting)}`),
            stat("replicas routed / warming", `${e.routed} / ${e.warming} of ${e.replicas}`),
            stat("replicas needed (p99 target)", num(e.replicas_needed, 2)),
            stat("requests/s · tokens/s", `${num(e.rate_per_s, 1)} · ${num(e.tokens_per_s)}`),
            stat(
              "warm-up p95 · lead time",
              `${ms(e.warmup_s)} · ${num(v.lead_time_s, 1)} s${v.warmup_measured ? " (measured)" : ""}`,
            ),
          ]
        : []),
    );
    // the timeline: history (control-plane time), then the plan's forecast bound ahead of it
    const fc = v.forecast || { times_s: [], upper_gpus: [] };
    const ahead = fc.times_s
      .map((ts, i) => [v.planned_s + (ts - v.serving_time_s) / (v.speedup || 1), fc.upper_gpus[i]])
      .filter(([t]) => !history.length || t > history[history.length - 1].t);
    const xs = history.map((h) => h.t).concat(ahead.map((a) => a[0]));
    const pad = (arr) => arr.concat(ahead.map(() => null));
    const data = [
      xs,
      pad(history.map((h) => h.demand)),
      pad(history.map((h) => h.upper)).map((x, i) => (i < history.length ? x : ahead[i - history.length][1])),
      pad(history.map((h) => h.lent)),
      pad(history.map((h) => h.capacity)),
      pad(history.map((h) => h.warming)),
      pad(history.map((h) => h.reclaiming)),
    ];
    holder.setAttribute("data-points", String(history.filter((h) => h.demand !== null).length));
    chart(
      holder,
      "loans",
      {
        ...timeAxis,
        title: "Serving demand, forecast bound, lent GPUs",
        series: [
          {},
          { label: "demand", stroke: "#0f172a", width: 2 },
          { label: "forecast upper bound", stroke: "#a855f7", dash: [6, 4], fill: "rgba(168,85,247,0.08)" },
          {
            label: "lent",
            stroke: "#10b981",
            width: 2,
            fill: "rgba(16,185,129,0.15)",
            paths: uPlot.paths.stepped({ align: 1 }),
          },
          { label: "serving capacity", stroke: "#64748b" },
          { label: "warming up", stroke: "#a855f7", paths: uPlot.paths.stepped({ align: 1 }) },
          { label: "under reclaim", stroke: "#ef4444", paths: uPlot.paths.stepped({ align: 1 }) },
        ],
        axes: [{}, { label: "GPUs" }],
      },
      data,
    );
    const onLoans = p.nodes
      .filter((n) => n.pool === "serving")
      .flatMap((n) =>
        n.segments
          .filter((sg) => sg.kind === "job" || sg.kind === "draining")
          .map((sg) => [n.name, jobLink(sg.job), sg.tenant, sg.gpus, sg.kind]),
      );
    info.replaceChildren(
      el("h2", {}, "Loans"),
      (v.loans || []).length
        ? table(
            ["node", "GPUs", "until"],
            v.loans.map((l) => [
              l.node,
              l.gpus,
              l.until_s === null ? "open" : `${clock(l.until_s)} (in ${ago(l.until_s - now)})`,
            ]),
            [1],
          )
        : el("p", { class: "muted" }, "Nothing lent."),
      el("h2", {}, "Reclaims"),
      reclaims.length
        ? table(
            ["GPUs", "notice", "deadline"],
            reclaims.map((r) => [
              r.gpus,
              `${clock(r.notice_s)} (${r.notice_s > now ? "in " + ago(r.notice_s - now) : "sent"})`,
              `${clock(r.by_s)} (in ${ago(r.by_s - now)})`,
            ]),
            [0],
          )
        : el("p", { class: "muted" }, "No reclaim planned."),
      el("h2", {}, "Jobs on lent GPUs (a reclaim takes from these)"),
      onLoans.length
        ? table(["node", "job", "tenant", "GPUs", ""], onLoans, [3])
        : el("p", { class: "muted" }, "None."),
    );
  };
}

function jobsPage(root, params) {
  const f = {
    state: params.get("state") || "",
    kind: params.get("kind") || "",
    tenant: params.get("tenant") || "",
    q: params.get("q") || "",
    offset: Number(params.get("offset")) || 0,
  };
  const go = () => {
    location.hash = "#/jobs?" + new URLSearchParams(Object.entries(f).filter(([, v]) => v));
  };
  const state = el(
    "select",
    {
      id: "f-state",
      "aria-label": "state",
      on: {
        change: (e) => {
          f.state = e.target.value;
          f.offset = 0;
          go();
        },
      },
    },
    el("option", { value: "" }, "any state"),
    STATES.map((s) => el("option", { value: s, selected: s === f.state }, s)),
  );
  const kind = el(
    "select",
    {
      id: "f-kind",
      "aria-label": "kind",
      on: {
        change: (e) => {
          f.kind = e.target.value;
          f.offset = 0;
          go();
        },
      },
    },
    el("option", { value: "" }, "any kind"),
    ["spot", "dedicated"].map((k) => el("option", { value: k, selected: k === f.kind }, k)),
  );
  const q = el("input", {
    id: "f-q",
    placeholder: "job id contains",
    value: f.q,
    "aria-label": "search",
    on: {
      change: (e) => {
        f.q = e.target.value;
        f.offset = 0;
        go();
      },
    },
  });
  const tenant = me.admin
    ? el("input", {
        id: "f-tenant",
        placeholder: "tenant",
        value: f.tenant,
        "aria-label": "tenant",
        on: {
          change: (e) => {
            f.tenant = e.target.value;
            f.offset = 0;
            go();
          },
        },
      })
    : null;
  const body = el("div", { id: "jobs-table" });
  const pager = el("div", { class: "pager" });
  root.append(el("h1", {}, "Jobs"), el("div", { class: "filters" }, state, kind, tenant, q), body, pager);
  return async () => {
    const qs = new URLSearchParams({ offset: f.offset, limit: PAGE });
    for (const k of ["state", "kind", "tenant", "q"]) if (f[k]) qs.set(k, f[k]);
    const r = await api("/v1/dashboard/jobs?" + qs);
    body.replaceChildren(
      r.jobs.length
        ? table(
            [
              "job",
              "state",
              "tenant",
              "kind",
              "GPUs now",
              "min–max",
              "step",
              "loss",
              "steps/s",
              "ETTR",
              "restarts",
              "submitted",
              "message",
            ],
            r.jobs.map((j) => [
              jobLink(j.id),
              stateTag(j.state),
              j.tenant,
              j.kind,
              j.gpus,
              `${j.min_gpus}–${j.max_gpus}`,
              num(j.step),
              num(j.loss, 4),
              num(j.steps_per_s, 2),
              pct(j.ettr),
              j.restarts,
              clock(j.submit_s),
              (j.message || "").slice(0, 120),
            ]),
            [4, 6, 7, 8, 9, 10],
          )
        : el("p", { class: "muted" }, "No jobs match."),
    );
    const last = Math.min(r.total, f.offset + r.jobs.length);
    pager.replaceChildren(
      el(
        "button",
        {
          type: "button",
          disabled: f.offset === 0,
          on: {
            click: () => {
              f.offset = Math.max(0, f.offset - PAGE);
              go();
            },
          },
        },
        "← newer",
      ),
      el("span", { id: "jobs-range" }, r.total ? `${f.offset + 1}–${last} of ${r.total}` : "0 jobs"),
      el(
        "button",
        {
          type: "button",
          disabled: last >= r.total,
          on: {
            click: () => {
              f.offset += PAGE;
              go();
            },
          },
        },
        "older →",
      ),
    );
  };
}

function jobPage(root, id) {
  const head = el("div", { id: "job-head" });
  const charts = el(
    "div",
    { class: "charts" },
    el("div", { class: "card" }, el("div", { class: "chart", id: "loss-chart" })),
    el("div", { class: "card" }, el("div", { class: "chart", id: "rate-chart" })),
  );
  const restarts = el("div", { id: "job-restarts" });
  const ckpt = el("div", { id: "job-ckpt" });
  const events = el("div", { id: "job-events" });
  const spec = el("details", {}, el("summary", {}, "spec"), el("pre", { id: "job-spec" }));
  root.append(
    el("p", {}, el("a", { href: "#/jobs" }, "← jobs")),
    head,
    charts,
    el("h2", {}, "Attempts and restarts"),
    restarts,
    el("h2", {}, "Checkpoints per tier"),
    ckpt,
    el("h2", {}, "Events"),
    events,
    spec,
  );
  const enc = encodeURIComponent(id);
  let ev = [],
    after = 0;
  const why = {}; // attempt -> how it ended (from every event seen, also those no longer listed)
  return async () => {
    const [j, cv, more, ck] = await Promise.all([
      api("/v1/jobs/" + enc),
      api("/v1/dashboard/jobs/" + enc + "/curves"),
      api(`/v1/events?limit=1000&after=${after}&job=` + enc),
      api("/v1/jobs/" + enc + "/checkpoints"),
    ]);
    for (const e of more)
      if (
        e.kind === "transition" &&
        ["backoff", "preempting", "resizing", "pending", "failed"].includes(e.to)
      ) {
        why[e.data && e.data.attempt !== undefined ? e.data.attempt : "?"] = e.message;
      }
    if (more.length) after = more[more.length - 1].id;
    ev = ev.concat(more).slice(-500); // the newest events only: a refresh reads those after the last seen
    const p = j.progress || {};
    head.replaceChildren(
      el("h1", {}, j.id, " ", stateTag(j.state)),
      el(
        "div",
        { class: "cards" },
        stat("tenant", j.tenant),
        stat("kind", j.kind),
        stat(
          "GPUs now / min / max",
          `${Object.values(j.placement || {}).reduce((a, b) => a + b, 0)} / ${j.gpus.min} / ${j.gpus.max}`,
        ),
        stat("step", num(p.step)),
        stat("loss", num(p.loss, 4)),
        stat("steps/s", num(p.steps_per_s, 2)),
        stat("ETTR", pct(j.report.ettr)),
        stat("attempt", j.attempt),
        stat("restarts", `${j.restarts} / ${j.max_restarts}`),
        stat("preemptions", j.preemptions),
        stat("lost work", ago(j.report.lost_work_s)),
      ),
      el("p", { class: "muted", id: "job-message" }, j.message || ""),
    );
    const xs = [],
      loss = [],
      rate = [];
    for (const a of cv.attempts) {
      for (const [t, , l, st] of a.points) {
        xs.push(t);
        loss.push(l);
        rate.push(st ? 1 / st : null);
      }
      if (a.points.length) {
        xs.push(a.points[a.points.length - 1][0] + 1e-3);
        loss.push(null);
        rate.push(null);
      }
    }
    $("loss-chart").setAttribute("data-points", String(loss.filter((x) => x !== null).length));
    chart(
      $("loss-chart"),
      "loss",
      { ...timeAxis, title: "Loss", series: [{}, { label: "loss", stroke: "#2563eb", width: 2 }] },
      [xs, loss],
    );
    chart(
      $("rate-chart"),
      "rate",
      {
        ...timeAxis,
        title: "Throughput",
        series: [{}, { label: "steps/s", stroke: "#10b981", width: 2 }],
        axes: [{}, { label: "steps/s" }],
      },
      [xs, rate],
    );
    restarts.replaceChildren(
      cv.attempts.length
        ? table(
            [
              "attempt",
              "restored step",
              "from tier",
              "restore s",
              "steps recorded",
              "last step",
              "checkpoints",
              "how it ended",
            ],
            cv.attempts.map((a) => [
              a.attempt,
              a.restore ? num(a.restore.step) : "—",
              a.restore ? a.restore.tier || "(none)" : "—",
              a.restore ? num(a.restore.duration_s, 2) : "—",
              a.steps_recorded,
              a.points.length ? a.points[a.points.length - 1][1] : "—",
              a.checkpoints.length,
              a.attempt === j.attempt && !["succeeded", "failed", "cancelled"].includes(j.state)
                ? "(running)"
                : why[a.attempt] || "",
            ]),
            [0, 1, 3, 4, 5, 6],
          )
        : el("p", { class: "muted" }, "Not launched yet."),
    );
    const now = Date.now() / 1000;
    ckpt.replaceChildren(
      el(
        "p",
        {},
        `newest step ${num(ck.newest_step)}; newest durable step ${num(ck.newest_durable_step)}` +
          (ck.durable_age_s !== null ? `, ${ago(ck.durable_age_s)} old` : "") +
          (ck.newest_step !== null && ck.newest_durable_step !== null
            ? `; durability lag ${ck.newest_step - ck.newest_durable_step} steps`
            : ""),
      ),
      ck.tiers.length
        ? table(
            ["tier", "kind", "durable", "newest step", "steps held", "age", "location", "error"],
            ck.tiers.map((t) => {
              const newest = t.steps.length ? t.steps[t.steps.length - 1] : null;
              const at = newest !== null ? t.committed_s[String(newest)] : undefined;
              return [
                t.name,
                t.kind,
                t.durable ? "yes" : "no",
                num(newest),
                t.steps.length,
                at ? ago(now - at) : "—",
                t.location,
                t.error || "",
              ];
            }),
            [3, 4],
          )
        : el("p", { class: "muted" }, "No checkpoint location known."),
    );
    events.replaceChildren(
      table(
        ["time", "kind", "from", "to", "message"],
        ev
          .slice(-200)
          .reverse()
          .map((e) => [clock(e.time_s), e.kind, e.from || "", e.to || "", e.message]),
      ),
    );
    $("job-spec").textContent = JSON.stringify(j.spec, null, 2);
  };
}

// ---------------------------------------------------------------------------------------------- shell
async function refresh() {
  if (busy || !current) return;
  busy = true;
  const page = current;
  try {
    await page.refresh();
    if (page === current) $("live").textContent = "updated " + clock(Date.now() / 1000);
  } catch (e) {
    if (e instanceof Unauthorized) {
      signOut("The token was refused; sign in again.");
      return;
    }
    if (page === current) {
      if (e instanceof NotFoundError)
        $("page").replaceChildren(el("h1", {}, "Not found"), el("p", {}, e.message));
      $("live").textContent = "update failed: " + e.message;
    }
  } finally {
    busy = false;
  }
}

function route() {
  if (!me) return;
  const hash = location.hash || "#/pool";
  const [path, query] = hash.slice(1).split("?");
  const params = new URLSearchParams(query || "");
  const root = $("page");
  if (current) for (const c of Object.values(current.charts)) c.destroy();
  root.replaceChildren();
  current = { charts: {} };
  let name = path.split("/")[1] || "pool";
  if (name === "job") current.refresh = jobPage(root, decodeURIComponent(path.slice(5)));
  else if (name === "serving") current.refresh = servingPage(root);
  else if (name === "jobs") current.refresh = jobsPage(root, params);
  else {
    name = "pool";
    current.refresh = poolPage(root);
  }
  current.name = name;
  root.setAttribute("data-page", name);
  for (const a of document.querySelectorAll("#nav a"))
    a.classList.toggle("active", a.dataset.page === name || (name === "job" && a.dataset.page === "jobs"));
  busy = false;
  refresh();
}

function signOut(msg) {
  sessionStorage.removeItem(TOKEN_KEY);
  me = null;
  current = null;
  clearInterval(timer);
  $("page").replaceChildren();
  $("nav").hidden = true;
  $("signout").hidden = true;
  $("who").textContent = "";
  $("live").textContent = "";
  $("login").hidden = false;
  $("login-error").textContent = msg || "";
}

async function signIn() {
  try {
    me = await api("/v1/whoami");
  } catch (e) {
    signOut(
      e instanceof Unauthorized
        ? "That token is not known to this Tidal."
        : "Cannot reach Tidal: " + e.message,
    );
    return;
  }
  $("login").hidden = true;
  $("nav").hidden = false;
  $("signout").hidden = false;
  $("who").textContent = me.admin ? "admin" : "tenant " + me.tenant;
  clearInterval(timer);
  timer = setInterval(refresh, REFRESH_MS);
  route();
}

$("login-form").addEventListener("submit", (e) => {
  e.preventDefault();
  const t = $("token").value.trim();
  $("token").value = "";
  if (!t) return;
  sessionStorage.setItem(TOKEN_KEY, t);
  signIn();
});
$("signout").addEventListener("click", () => signOut(""));
window.addEventListener("hashchange", route);
if (sessionStorage.getItem(TOKEN_KEY)) signIn();
else signOut("");
