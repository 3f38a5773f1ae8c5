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


def assemble(runs_path, meta_path, out_path):
    meta = json.load(open(meta_path, encoding="utf-8"))
    runs = [json.loads(l) for l in open(runs_path, encoding="utf-8") if l.strip()]
    pg = {(r["scenario"], r["clients"]): r for r in runs if r["tool"] == "pgbench"}
    rows = []
    for r in runs:
        if r["tool"] != "cobro":
            continue
        base = pg.get((r["baseline"], r["clients"]))
        tps = base["tps"] if base else None
        rows.append({
            "scenario": r["scenario"],
            "clients": r["clients"],
            "cobro_per_s": r["rps"],
            "cobro_p50_ms": r.get("p50_ms"),
            "cobro_p99_ms": r.get("p99_ms"),
            "pgbench_tps": tps,
            "pgbench_p50_ms": base.get("p50_ms") if base else None,
            "pgbench_p99_ms": base.get("p99_ms") if base else None,
            "ratio": round(r["rps"] / tps, 3) if tps else None,
            "pg_cpu_ms_per_op_pgbench": base.get("pg_cpu_ms_per_op") if base else None,
            "pg_cpu_ms_per_op_cobro": r.get("pg_cpu_ms_per_op"),
            "cobro_cpu_ms_per_op": r.get("cobro_cpu_ms_per_op"),
            "baseline": r["baseline"],
            "detail": {k: v for k, v in r.items() if k not in ("tool", "scenario", "clients", "baseline")},
            "pgbench_detail": base,
        })
    result = dict(meta, results=rows)
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
        f.write("\n")

    head = ["scenario", "clients", "cobro/s", "pgbench tx/s", "ratio",
            "cobro p50/p99 ms", "pgbench p50/p99 ms",
            "PG CPU ms/op pgbench / cobro", "cobro CPU ms/op"]
    table = [head]
    for row in rows:
        table.append([
            row["scenario"], str(row["clients"]), fmt(row["cobro_per_s"]),
            fmt(row["pgbench_tps"]), fmt(row["ratio"], 2),
            f'{fmt(row["cobro_p50_ms"], 2)} / {fmt(row["cobro_p99_ms"], 2)}',
            f'{fmt(row["pgbench_p50_ms"], 2)} / {fmt(row["pgbench_p99_ms"], 2)}',
            f'{fmt(row["pg_cpu_ms_per_op_pgbench"], 3)} / {fmt(row["pg_cpu_ms_per_op_cobro"], 3)}',
            fmt(row["cobro_cpu_ms_per_op"], 3),
        ])
    widths = [max(len(r[i]) for r in table) for i in range(len(head))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"
    print(line(table[0]))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in table[1:]:
        print(line(r))


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
