#!/usr/bin/env python3
"""Helpers of ops/bench.sh (standard library only).

  report.py pgbench STDOUT LOG_PREFIX     -> one JSON object: tps, latency percentiles
  report.py assemble RUNS META OUT_JSON   -> writes OUT_JSON, prints the table
  report.py record JSON KEY=VALUE...       -> JSON with the pairs added (numbers and true/false cast)
  report.py cpu PID                       -> CPU seconds used so far by PID and its reaped children
  report.py cpu-tree PID                  -> the same plus its live children (a postmaster and its backends)

RUNS is a JSON-lines file, one object per measured run, written by bench.sh.
"""
import glob
import json
import re
import sys


def percentile(sorted_values, p):
    if not sorted_values:
        return None
    k = max(0, min(len(sorted_values) - 1, round(p / 100 * len(sorted_values)) - 1))
    return sorted_values[k]


def pgbench(stdout_path, log_prefix):
    text = open(stdout_path, encoding="utf-8", errors="replace").read()

    def grab(pattern, cast=float):
        m = re.search(pattern, text, re.MULTILINE)
        return cast(m.group(1)) if m else None

    latencies = []
    failed_logged = 0
    for path in glob.glob(log_prefix + ".*"):
        with open(path, encoding="utf-8") as f:
            for line in f:
                fields = line.split()
                if len(fields) < 3:
                    continue
                if fields[2].isdigit():
                    latencies.append(int(fields[2]))
                else:  # "failed" or "skipped"
                    failed_logged += 1
    latencies.sort()
    ms = lambda us: None if us is None else round(us / 1000, 3)
    out = {
        "tps": grab(r"^tps = ([0-9.]+)"),
        "transactions": grab(r"^number of transactions actually processed: (\d+)", int),
        "failed": grab(r"^number of failed transactions: (\d+)", int) or failed_logged,
        "mean_ms": grab(r"^latency average = ([0-9.]+) ms"),
        "p50_ms": ms(percentile(latencies, 50)),
        "p90_ms": ms(percentile(latencies, 90)),
        "p99_ms": ms(percentile(latencies, 99)),
    }
    if out["tps"] is None or not out["transactions"]:
        sys.exit(f"report.py: no tps in pgbench output {stdout_path}")
    print(json.dumps(out))


def _ticks(stat_path, with_reaped):
    with open(stat_path, encoding="utf-8") as f:
        text = f.read()
    # Fields after the command name, which is in parentheses: state is field 3.
    fields = text[text.rindex(")") + 2:].split()
    ppid = int(fields[1])
    utime, stime, cutime, cstime = (int(x) for x in fields[11:15])
    return ppid, utime + stime + ((cutime + cstime) if with_reaped else 0)


def cpu(pid, tree):
    import os
    _, total = _ticks(f"/proc/{pid}/stat", True)
    if tree:
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                ppid, ticks = _ticks(f"/proc/{entry}/stat", False)
            except (OSError, ValueError):
                continue
            if ppid == pid:
                total += ticks
    print(f"{total / os.sysconf('SC_CLK_TCK'):.2f}")


def record(base, pairs):
    r = json.loads(base) if base else {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        for cast in (int, float):
            try:
                value = cast(value)
                break
            except ValueError:
                pass
        else:
            value = {"true": True, "false": False}.get(value, value)
        r[key] = value
    print(json.dumps(r))


def fmt(v, digits=0):
    if v is None:
        return "-"
    return f"{v:,.{digits}f}" if isinstance(v, (int, float)) else str(v)


def spread(values):
    """Median, min, max and every value of the rounds (None when empty)."""
    import statistics
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"median": round(statistics.median(values), 3), "min": min(values),
            "max": max(values), "rounds": values}


def fmt_spread(s, digits=0):
    if not s:
        return "-"
    if len(s["rounds"]) == 1:
        return fmt(s["median"], digits)
    return f'{fmt(s["median"], digits)} [{fmt(s["min"], digits)}-{fmt(s["max"], digits)}]'


def median_of(s):
    return s["median"] if s else None


def ratio(a, b):
    return round(a / b, 3) if a is not None and b else None


# The pgbench script a cobro scenario is measured against (None: no ceiling).
BASELINE = {"new_payment": "new_payment", "replay": "replay", "get_payment": "get_payment", "e2e": "e2e"}
# The embedded default's targets (issue 15, item 4): rate and p99 of new payments.
SQLITE_TARGET = {"rate": 1000, "p99_ms": 50}


def summarise(runs):
    """One row per (store, durability, scenario, clients): the rounds' rates
    and latencies as median [min-max], and per round the ratio to the
    pgbench run of the same round (ABAB: pgbench then cobro)."""
    groups = {}
    for r in runs:
        if r["tool"] != "cobro" or r["scenario"] in ("memory", "drain"):
            continue
        key = (r["store"], r["durability"], r["scenario"], r["clients"])
        groups.setdefault(key, []).append(r)
    pg = {(r["durability"], r["scenario"], r["clients"], r["round"]): r
          for r in runs if r["tool"] == "pgbench"}
    rows = []
    for (store, durability, scenario, clients), mine in groups.items():
        mine.sort(key=lambda r: r["round"])
        base = BASELINE.get(scenario) if store == "postgres" else None
        theirs = [pg.get((durability, base, clients, r["round"])) for r in mine] if base else []
        theirs = [t for t in theirs if t]
        pairs = [(m, pg.get((durability, base, clients, m["round"]))) for m in mine] if base else []
        row = {
            "store": store, "durability": durability, "scenario": scenario, "clients": clients,
            "baseline": base, "rounds": len(mine),
            "cobro_rate": spread([m["rate"] for m in mine]),
            "cobro_p50_ms": spread([m.get("p50_ms") for m in mine]),
            "cobro_p99_ms": spread([m.get("p99_ms") for m in mine]),
            "pgbench_rate": spread([t["rate"] for t in theirs]),
            "pgbench_p50_ms": spread([t.get("p50_ms") for t in theirs]),
            "pgbench_p99_ms": spread([t.get("p99_ms") for t in theirs]),
            "ratio": spread([ratio(m["rate"], t["rate"]) for m, t in pairs if t]),
            "p99_ratio": spread([ratio(m.get("p99_ms"), t.get("p99_ms")) for m, t in pairs if t]),
            "pg_cpu_ms_per_op_pgbench": spread([t.get("pg_cpu_ms_per_op") for t in theirs]),
            "pg_cpu_ms_per_op_cobro": spread([m.get("pg_cpu_ms_per_op") for m in mine]),
            "cobro_cpu_ms_per_op": spread([m.get("cobro_cpu_ms_per_op") for m in mine]),
            "loadavg_1m": [{"round": m["round"], "cobro": m.get("loadavg_1m"),
                            "pgbench": t.get("loadavg_1m") if t else None} for m, t in
                           (pairs or [(m, None) for m in mine])],
        }
        if scenario == "e2e":
            row["backlog_at_load_end"] = spread([m.get("backlog_at_load_end") for m in mine])
            row["backlog_seconds_of_intake"] = spread([m.get("backlog_seconds_of_intake") for m in mine])
            row["http_rps"] = spread([m.get("http_rps") for m in mine])
            if store == "sqlite":
                row["webhooks_behind_at_load_end"] = spread([m.get("webhooks_behind_at_load_end") for m in mine])
        if store == "sqlite" and scenario == "new_payment":
            rate, p99 = median_of(row["cobro_rate"]), median_of(row["cobro_p99_ms"])
            row["target"] = dict(SQLITE_TARGET, met=bool(rate and p99 and rate >= SQLITE_TARGET["rate"]
                                                          and p99 < SQLITE_TARGET["p99_ms"]))
        rows.append(row)
    return rows


def table(head, body):
    lines = [head] + body
    widths = [max(len(r[i]) for r in lines) for i in range(len(head))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"
    print(line(head))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in body:
        print(line(r))


def loads(row):
    return " ".join(f'{fmt(l["pgbench"], 1)}/{fmt(l["cobro"], 1)}' if l["pgbench"] is not None
                    else fmt(l["cobro"], 1) for l in row["loadavg_1m"])


def assemble(runs_path, meta_path, out_path):
    meta = json.load(open(meta_path, encoding="utf-8"))
    runs = [json.loads(l) for l in open(runs_path, encoding="utf-8") if l.strip()]
    rows = summarise(runs)
    memory = [{k: r.get(k) for k in ("store", "durability", "load_seconds", "clients", "rate",
                                     "rss_idle_kib", "hwm_idle_kib", "rss_loaded_kib", "hwm_loaded_kib")}
              for r in runs if r["scenario"] == "memory"]
    drain = [{k: r.get(k) for k in ("durability", "workers", "payments", "seconds", "rate", "not_captured",
                                    "worker_cpu_ms_per_payment", "pg_cpu_ms_per_op",
                                    "fake_provider_cpu_ms_per_op", "loadavg_1m")}
             for r in runs if r["scenario"] == "drain"]
    result = dict(meta, summary=rows, memory=memory, drain=drain, runs=runs)
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
        f.write("\n")

    pg_rows = [r for r in rows if r["store"] == "postgres"]
    if pg_rows:
        print("PostgreSQL: median [min-max] of the rounds; ratio = cobro/s / pgbench tx/s of the same round")
        table(["durability", "scenario", "clients", "cobro/s", "pgbench tx/s", "ratio",
               "p99 ms cobro / pgbench", "p99 ratio", "PG CPU ms/op pgbench / cobro",
               "cobro CPU ms/op", "load 1m pgbench/cobro per round"],
              [[r["durability"], r["scenario"], str(r["clients"]), fmt_spread(r["cobro_rate"]),
                fmt_spread(r["pgbench_rate"]), fmt_spread(r["ratio"], 2),
                f'{fmt(median_of(r["cobro_p99_ms"]), 2)} / {fmt(median_of(r["pgbench_p99_ms"]), 2)}',
                fmt_spread(r["p99_ratio"], 2),
                f'{fmt(median_of(r["pg_cpu_ms_per_op_pgbench"]), 3)} / {fmt(median_of(r["pg_cpu_ms_per_op_cobro"]), 3)}',
                fmt(median_of(r["cobro_cpu_ms_per_op"]), 3), loads(r)] for r in pg_rows])
        e2e = [r for r in pg_rows if r["scenario"] == "e2e"]
        if e2e:
            print()
            print("End to end (created and captured/s against e2e.sql): the backlog when the load stopped")
            table(["durability", "clients", "POST/s", "captured/s", "backlog at load end",
                   "backlog in seconds of intake"],
                  [[r["durability"], str(r["clients"]), fmt_spread(r["http_rps"]), fmt_spread(r["cobro_rate"]),
                    fmt_spread(r["backlog_at_load_end"]), fmt_spread(r["backlog_seconds_of_intake"], 2)]
                   for r in e2e])
    sq_rows = [r for r in rows if r["store"] == "sqlite"]
    if sq_rows:
        print()
        print("SQLite (the embedded default, worker and fake provider in process): no pgbench ceiling")
        table(["scenario", "clients", "per s", "p50 ms", "p99 ms", "cobro CPU ms/op", "target",
               "at load end: payments / events not yet in", "load 1m per round"],
              [[r["scenario"], str(r["clients"]), fmt_spread(r["cobro_rate"]), fmt_spread(r["cobro_p50_ms"], 2),
                fmt_spread(r["cobro_p99_ms"], 2), fmt(median_of(r["cobro_cpu_ms_per_op"]), 3),
                (">=1000/s, p99 < 50 ms: " + ("met" if r["target"]["met"] else "not met")) if "target" in r else "",
                f'{fmt_spread(r["backlog_at_load_end"])} / {fmt_spread(r["webhooks_behind_at_load_end"])}'
                if "webhooks_behind_at_load_end" in r else "",
                loads(r)] for r in sq_rows])
    if memory:
        print()
        print("Memory of cobro serve (VmRSS; VmHWM is the peak), MiB")
        mib = lambda k: fmt(k / 1024, 1) if k else "-"
        table(["store", "idle VmRSS", "after load VmRSS", "after load VmHWM", "load"],
              [[m["store"], mib(m["rss_idle_kib"]), mib(m["rss_loaded_kib"]), mib(m["hwm_loaded_kib"]),
                f'{m["load_seconds"]} s of new payments, c={m["clients"]}, {fmt(m["rate"])}/s'] for m in memory])
    if drain:
        print()
        print("Drain alone (payments created first, no intake), by cobro worker processes")
        table(["durability", "workers", "payments", "drained/s", "worker CPU ms/payment (each)",
               "PG CPU ms/payment", "fake-provider CPU ms/payment", "load 1m"],
              [[d["durability"], str(d["workers"]), str(d["payments"]), fmt(d["rate"]),
                str(d["worker_cpu_ms_per_payment"]).replace(",", " "), fmt(d["pg_cpu_ms_per_op"], 3),
                fmt(d["fake_provider_cpu_ms_per_op"], 3), fmt(d["loadavg_1m"], 1)] for d in drain])


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "pgbench":
        pgbench(sys.argv[2], sys.argv[3])
    elif len(sys.argv) >= 3 and sys.argv[1] == "record":
        record(sys.argv[2], sys.argv[3:])
    elif len(sys.argv) == 3 and sys.argv[1] in ("cpu", "cpu-tree"):
        cpu(int(sys.argv[2]), sys.argv[1] == "cpu-tree")
    elif len(sys.argv) == 5 and sys.argv[1] == "assemble":
        assemble(sys.argv[2], sys.argv[3], sys.argv[4])
    else:
        sys.exit(__doc__)
