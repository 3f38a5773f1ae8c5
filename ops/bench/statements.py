#!/usr/bin/env python3
"""The statement check of ops/bench/statements.sh (standard library only).

  statements.py SERVER_LOG BENCH_DIR OUT_JSON

Reads a PostgreSQL log written with log_line_prefix '%m|%p|%a|',
log_statement = all, log_min_duration_statement = 0 and auto_explain with
log_nested_statements (so the NOTIFY that a trigger sends shows), cut into
windows by marker statements `SELECT 'statements-mark:NAME'`. For every
scenario it takes the statements cobro sent (by application_name) and those
pgbench sent running the matching ops/bench/*.sql, normalises them (each
placeholder to `?`, or to NULL when cobro bound NULL to it; whitespace;
a trailing `;`; the `-- mirrors:` substitutions the scripts declare) and
prints every difference. Exit status 1 when any scenario differs.
"""
import difflib
import json
import re
import sys

PREFIX = re.compile(r"^(\d{4}-\d\d-\d\d [\d:.]+ \S+)\|(\d+)\|([^|]*)\|([A-Z]+):  (.*)$")
PARAM = re.compile(r"\$(\d+) = (NULL|'(?:[^']|'')*')")
MARK = re.compile(r"^statement: SELECT 'statements-mark:([\w-]+)'")

# Scenario: (cobro's application names and marker windows, pgbench's application name).
SCENARIOS = {
    "new_payment": ([("cobro-api", "new_payment")], "pgbench-new_payment", ["new_payment.sql"]),
    "replay": ([("cobro-api", "replay")], "pgbench-replay", ["replay.sql"]),
    "get_payment": ([("cobro-api", "get_payment")], "pgbench-get_payment", ["get_payment.sql"]),
    # The whole SQL of one payment: its POST, then the worker's claim, send
    # and settle (pgbench runs new_payment.sql then worker.sql as e2e.sql).
    "e2e": ([("cobro-api", "new_payment"), ("cobro-worker", "new_payment")], "pgbench-e2e",
            ["new_payment.sql", "worker.sql"]),
}


def records(path):
    """The log's records: (pid, app, level, message with continuation lines)."""
    out = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            line = line.rstrip("\n")
            m = PREFIX.match(line)
            if m:
                out.append([m.group(2), m.group(3), m.group(4), m.group(5)])
            elif out:
                out[-1][3] += "\n" + line
    return out


def windows(recs):
    """Each record tagged with the marker window it falls in."""
    current = None
    tagged = []
    for pid, app, level, msg in recs:
        m = MARK.match(msg) if level == "LOG" else None
        if m:
            current = m.group(1)
            continue
        tagged.append((current, pid, app, level, msg))
    return tagged


def params(detail):
    return {int(n): (None if v == "NULL" else v) for n, v in PARAM.findall(detail)}


def sequence(tagged, app, window):
    """The statements `app` sent in `window`, in order, with protocol counts."""
    items = []
    counts = {"parse": 0, "bind": 0, "execute": 0, "simple": 0}
    last = None
    for win, _pid, rec_app, level, msg in tagged:
        if win != window or rec_app != app:
            continue
        if level == "DETAIL" and msg.startswith("parameters:") and last is not None:
            last["params"] = params(msg)
            continue
        if level != "LOG":
            continue
        m = re.match(r"^statement: (.*)$", msg, re.S)
        if m:
            counts["simple"] += 1
            last = {"protocol": "simple", "text": m.group(1), "params": {}}
            items.append(last)
            continue
        m = re.match(r"^execute [^:]*: (.*)$", msg, re.S)
        if m:
            counts["execute"] += 1
            last = {"protocol": "extended", "text": m.group(1), "params": {}}
            items.append(last)
            continue
        m = re.match(r"^duration: [\d.]+ ms  (parse|bind) [^:]*: ", msg)
        if m:
            counts[m.group(1)] += 1
            last = None  # a bind's parameters are the execute's, logged again after it
            continue
        m = re.match(r"^duration: [\d.]+ ms  plan:\n(.*)$", msg, re.S)
        if m:
            q = re.search(r"Query Text: (.*)", m.group(1))
            channel = re.search(r"pg_notify\('([^']+)'", q.group(1)) if q else None
            if channel:
                items.append({"protocol": "trigger", "text": f"NOTIFY {channel.group(1)}", "params": {}})
    return items, counts


def normalise(item, mirrors):
    text = re.sub(r"--[^\n]*", "", item["text"])
    text = re.sub(r"\s+", " ", text).strip().rstrip(";").strip()
    ps = item["params"]
    text = re.sub(r"\$(\d+)", lambda m: "NULL" if int(m.group(1)) in ps and ps[int(m.group(1))] is None
                  else "?", text)
    return mirrors.get(text, text)


# A script's statement that stands for nothing cobro sends.
PGBENCH_ONLY = "(pgbench only)"

# What cobro sends that the scripts leave out because under load it is not
# per request: the doorbell after a commit that enqueued work or moved a
# payment (crates/store Doorbells: at most one per channel per 2 ms per
# process, however many commits rang it), and the token lookup of a token
# cache miss (once per token per COBRO_TOKEN_CACHE_TTL). cobro pays them in
# the bench and pgbench does not, so they only ever lower cobro's ratio.
# Left out of the comparison and counted.
AMORTISED = {
    "SELECT pg_notify(?, '')",
    "SELECT account_id, expires_at FROM api_tokens WHERE token_hash = ? AND revoked_at IS NULL "
    "AND (expires_at IS NULL OR expires_at > ?)",
}


def declared_mirrors(script_path):
    """`-- mirrors: TEXT` before a statement of a script: the statement
    stands for cobro's TEXT (it also returns what cobro makes in process,
    through \\gset). `-- pgbench-only: WHY`: the statement stands for
    nothing cobro sends (it makes in one round trip without a table what
    cobro makes in process); it is left out of the comparison and counted.
    Keys: the script's statement, normalised as logged."""
    out = {}
    try:
        lines = open(script_path, encoding="utf-8").read().split("\n")
    except OSError:
        return out
    i = 0
    while i < len(lines):
        m = re.match(r"^--\s*(mirrors|pgbench-only):\s*(.*)$", lines[i])
        if not m:
            i += 1
            continue
        mirror = m.group(2).strip() if m.group(1) == "mirrors" else PGBENCH_ONLY
        j = i + 1
        while j < len(lines) and lines[j].startswith("--"):
            if mirror is not PGBENCH_ONLY:
                mirror += " " + lines[j][2:].strip()
            j += 1
        stmt = []
        while j < len(lines):
            stmt.append(lines[j])
            if re.search(r"(;|\\gset(\s+\w+)?)\s*$", lines[j]):
                break
            j += 1
        text = re.sub(r"\\gset(\s+\w+)?\s*$", "", " ".join(stmt).rstrip())
        text = re.sub(r"(?<!:):[a-z_]+", "?", text)
        text = re.sub(r"\s+", " ", text).strip().rstrip(";").strip()
        out[text] = mirror if mirror is PGBENCH_ONLY else re.sub(r"\s+", " ", mirror).strip().rstrip(";")
        i = j + 1
    return out


def main(log_path, bench_dir, out_path):
    tagged = windows(records(log_path))
    failed = False
    report = {}
    for name, (cobro_parts, pgbench_app, scripts) in SCENARIOS.items():
        mirrors = {}
        for script in scripts:
            mirrors.update(declared_mirrors(f"{bench_dir}/{script}"))
        script = " + ".join(scripts)
        cobro_items, cobro_counts = [], {"parse": 0, "bind": 0, "execute": 0, "simple": 0}
        for app, window in cobro_parts:
            items, counts = sequence(tagged, app, window)
            cobro_items += items
            cobro_counts = {k: cobro_counts[k] + counts[k] for k in counts}
        pg_items, pg_counts = sequence(tagged, pgbench_app, "pgbench-" + name)
        a = [normalise(i, {}) for i in cobro_items]
        amortised = sum(1 for t in a if t in AMORTISED)
        a = [t for t in a if t not in AMORTISED]
        b = [normalise(i, mirrors) for i in pg_items]
        extra = sum(1 for t in b if t == PGBENCH_ONLY)
        b = [t for t in b if t != PGBENCH_ONLY]
        same = a == b and bool(a)
        failed |= not same
        trips = lambda items: sum(1 for i in items if i["protocol"] != "trigger")
        print(f"== {name}: cobro {trips(cobro_items)} statements {cobro_counts}"
              + (f", {amortised} of them amortised under load" if amortised else "") + "; "
              f"pgbench ({script}) {trips(pg_items)} statements {pg_counts}"
              + (f", {extra} of them pgbench-only" if extra else "") + ": "
              + ("SAME" if same else "DIFFERENT"))
        if not a:
            print("   cobro sent no statement in this window (did the scenario run?)")
        if not same:
            for line in difflib.unified_diff(a, b, "cobro", script, lineterm="", n=1):
                print("   " + line)
        report[name] = {"same": same, "cobro": a, "pgbench": b, "pgbench_only": extra,
                        "cobro_amortised": amortised,
                        "cobro_counts": cobro_counts,
                        "pgbench_counts": pg_counts,
                        "cobro_protocols": [i["protocol"] for i in cobro_items],
                        "pgbench_protocols": [i["protocol"] for i in pg_items]}
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    print(f"statements: {out_path}")
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    sys.exit(main(*sys.argv[1:]))
