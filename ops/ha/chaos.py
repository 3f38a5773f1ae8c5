#!/usr/bin/env python3
"""Merchants at a steady rate against cobro while the PostgreSQL primary
fails, then the judgement (issue 47). Driven by ops/ha/chaos.sh, which
starts the cluster, the fake provider and cobro; standard library only.

Merchants: two accounts that share every name they can (the same
Idempotency-Keys, the same order refs), several threads each. A merchant
keeps one key per payment and retries it on 503, 409, 429 and on a cut
connection until it gets a 2xx, as crates/api/docs/api.md tells clients
to; what it got is its own record.

Faults, one after another, each once the cluster has a synchronous standby
again and after a quiet gap: `switchover`, `kill-primary` (SIGKILL of the
postmaster), `kill-node` (SIGKILL of the leader's Patroni and PostgreSQL),
`freeze` (SIGSTOP of the leader's Patroni and PostgreSQL, SIGCONT later).
Write unavailability of a fault: the longest stretch without a committed
payment (201, not a replay) from the fault until the next one, and when
that stretch ended, counted from the fault (see measure()).

Judgement, after the worker has settled what it can, and after a run of
the books (`cobro books`, docs/books.md) over the whole load:
- every payment a merchant got a 2xx for exists, with its order ref and
  amount, and the same id on every answer for its key;
- no intent (account + intent) charged twice in the provider's ledger;
- every charge in the ledger names a cobro payment (metadata) that its
  account can read and whose provider_ref is that charge;
- every payment that exists has converged (none left processing or in
  reconciliation);
- the books found no orphan and nothing missing;
- no 500 was answered.
With `--mode async` (asynchronous replication, which a failover may cut
short) losses are expected, and the judgement is that the books found them:
an acknowledged payment that no longer exists is a loss; every charge not
traced to a payment, and every second charge of an intent, must be an
orphan the books recorded. Losses without a charge moved no money and are
counted apart.
Exit status 1 if any of these fails.
"""

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid

# The provider's own faults during the run (fake-provider/README.md,
# "Faults"): answers lost after the charge, failures before and after it,
# and slow answers, so that failovers meet attempts of every kind of
# unknown outcome.
PROVIDER_FAULTS = [
    {"operation": "charge", "action": "drop_response_after_effect", "probability": 0.03},
    {"operation": "charge", "action": "fail_before_effect", "probability": 0.03},
    {"operation": "charge", "action": "fail_after_effect", "probability": 0.02},
    {"operation": "any", "action": "latency", "probability": 0.05, "delay_ms": 300},
]

LOCK = threading.Lock()
ATTEMPTS = []  # (sent, received, status, replayed)
PAYMENTS = []  # one dict per payment a merchant started
STOP = threading.Event()


def request(method, url, token=None, key=None, body=None, timeout=30):
    """(status, headers, parsed body); status None when the connection failed."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    if key:
        req.add_header("Idempotency-Key", key)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
            return r.status, r.headers, json.loads(raw) if raw else None
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            parsed = json.loads(raw) if raw else None
        except ValueError:
            parsed = None
        return e.code, e.headers, parsed
    except (urllib.error.URLError, OSError, TimeoutError):
        return None, {}, None


def cobro_url(args, n):
    """The API process for request n: the merchants' requests go round the
    processes, as behind a load balancer."""
    return args.cobro[n % len(args.cobro)]


def pay(args, merchant, token, n):
    """One payment, retried with its key until a 2xx (or a final 4xx)."""
    key = f"{args.run}-k{n}"
    order = f"{args.run}-order-{n}"
    amount = 1000 + n % 500
    body = {"order_ref": order, "amount": amount, "currency": "EUR", "payment_method": "pm_card_visa"}
    record = {"merchant": merchant, "key": key, "order_ref": order, "amount": amount,
              "ids": set(), "statuses": [], "ok_at": None}
    with LOCK:
        PAYMENTS.append(record)
    deadline = time.time() + args.give_up
    for tries in itertools.count(n):
        if time.time() >= deadline:
            break
        sent = time.time()
        status, headers, parsed = request("POST", f"{cobro_url(args, tries)}/v1/payments", token, key, body)
        received = time.time()
        replayed = bool(headers) and headers.get("Idempotent-Replayed") == "true"
        with LOCK:
            ATTEMPTS.append((sent, received, status, replayed))
        record["statuses"].append(status)
        if status is not None and 200 <= status < 300:
            record["ids"].add(parsed["id"])
            if record["ok_at"] is None:
                record["ok_at"] = received
            return
        if status in (400, 401, 403, 404, 422):
            record["final"] = status
            return
        time.sleep(0.2 if status in (503, 409, 429) else 0.5)
    record["gave_up"] = True


def merchant_thread(args, merchant, token, counter, period):
    while not STOP.is_set():
        started = time.time()
        with LOCK:
            n = next(counter)
        pay(args, merchant, token, n)
        rest = period - (time.time() - started)
        if rest > 0:
            STOP.wait(rest)


def cluster(args, *cmd, check=True):
    return subprocess.run([args.cluster, *cmd], check=check, capture_output=True, text=True)


def run_faults(args):
    results = []
    for kind in args.faults.split(","):
        time.sleep(args.gap)
        # Each fault starts on a recovered cluster: one node answering
        # /primary, a synchronous standby, and payments committing again.
        ready_by = time.time() + 180
        while time.time() < ready_by:
            leader = cluster(args, "leader", check=False).stdout.strip()
            sync = cluster(args, "wait-sync", "1", check=False).returncode == 0
            with LOCK:
                recent = any(r > time.time() - 2 for (s, r, st, rep) in ATTEMPTS if st == 201 and not rep)
            if leader and sync and recent:
                break
            time.sleep(0.5)
        else:
            print(f"chaos: cluster not ready before {kind} (leader {leader or 'none'})", file=sys.stderr)
        before = cluster(args, "status", check=False).stdout
        command = {"switchover": ["switchover"], "kill-primary": ["kill-primary"],
                   "kill-node": ["kill-node", str(args.node_down)],
                   "kill-node-lagging": ["kill-node-lagging", str(args.node_down)],
                   "freeze": ["freeze-primary", str(args.freeze)]}[kind]
        t0 = time.time()
        done = cluster(args, *command, check=False)
        t_done = time.time()
        if done.returncode != 0:
            print(f"chaos: {kind} failed: {done.stderr.strip()}", file=sys.stderr)
        # Back: a payment created by a request sent after the fault's
        # command returned (one sent before it may have committed before
        # the fault took effect).
        back = None
        while back is None and time.time() < t0 + 120:
            time.sleep(0.2)
            with LOCK:
                firsts = [r for (s, r, st, rep) in ATTEMPTS if s >= t_done and st == 201 and not rep]
            if firsts:
                back = min(firsts) - t0
        results.append({"fault": kind, "leader": leader, "t0": t0, "first_commit_s": back})
        if args.status_log:
            after = cluster(args, "status", check=False).stdout
            with open(args.status_log, "a") as f:
                f.write(f"== {kind} of {leader} at {time.strftime('%H:%M:%S', time.gmtime(t0))}\n"
                        f"before:\n{before}after (first commit):\n{after}\n")
        print(f"chaos: {kind} of {leader}: writes back after "
              f"{'never (120 s)' if back is None else f'{back:.1f} s'}", file=sys.stderr)
    return results


def measure(faults, end):
    """Each fault's write unavailability: the longest stretch without a
    committed payment (a 201 that is no replay, by its answer's time) from
    the fault to the next fault (or the end of the load). A switchover's
    command returns after the demotion, so "first commit after the
    command started" would be a commit before the demotion: the gap is
    what a merchant saw."""
    with LOCK:
        commits = sorted(r for (s, r, st, rep) in ATTEMPTS if st == 201 and not rep)
    for i, f in enumerate(faults):
        t0 = f["t0"]
        until = faults[i + 1]["t0"] if i + 1 < len(faults) else end
        # Stretches between consecutive commits, clipped to [fault, next
        # fault): a stretch that straddles the next fault is that fault's
        # outage (a fault starts only once payments commit again, so
        # commits were flowing just before it).
        last = i + 1 == len(faults)
        gaps = [(e - max(a, t0), e)
                for a, e in ((a, b if last else min(b, until)) for a, b in zip([t0] + commits, commits + [end]))
                if e > t0 and a < until]
        if not gaps:
            f["unavailable_s"] = None
            continue
        gap, back = max(gaps)
        f["unavailable_s"] = round(gap, 2)
        f["back_after_s"] = round(back - t0, 2)
        f["first_commit_s"] = None if f["first_commit_s"] is None else round(f["first_commit_s"], 2)
    return commits


def settle(args, tokens):
    """Waits (at most --settle seconds in all) for the worker and the
    reconciler to settle every payment; returns them by id."""
    found = {}
    deadline = time.time() + args.settle
    pending = [(p["merchant"], pid) for p in PAYMENTS for pid in p["ids"]]
    while pending:
        still = []
        for merchant, pid in pending:
            # Once the time is up, one last look at each, without waiting.
            wait = "?wait=1" if time.time() < deadline else ""
            status, _, body = request("GET", f"{args.cobro[0]}/v1/payments/{pid}{wait}", tokens[merchant])
            if status == 200:
                found[pid] = body
                if body["status"] in ("processing", "requires_reconciliation"):
                    still.append((merchant, pid))
            elif status != 404:
                still.append((merchant, pid))
            else:
                found[pid] = None
        if time.time() >= deadline:
            break
        pending = still
    return found


def books(args, started):
    """A run of the books over the load's window, then every orphan they
    hold: {provider object id: orphan}. The run's own report too."""
    since = f"{int(time.time() - started) + 120}s"
    run = subprocess.run([args.cobro_bin, "books", "--from", since, "--json"],
                         capture_output=True, text=True)
    # Exit 3: something is not matched, which is for the judgement to weigh.
    if run.returncode not in (0, 3):
        raise SystemExit(f"chaos: cobro books failed ({run.returncode}): {run.stderr.strip()}")
    report = json.loads(run.stdout)
    listed = subprocess.run([args.cobro_bin, "books", "orphans", "--all", "--limit", "10000", "--json"],
                            capture_output=True, text=True, check=True)
    orphans = {o["object"]: o for o in json.loads(listed.stdout)["orphans"]}
    return report, orphans


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cobro", required=True, action="append", help="an API process's base URL (repeat)")
    ap.add_argument("--cobro-bin", required=True, help="the cobro binary, for the books")
    ap.add_argument("--mode", choices=("sync", "async"), default="sync",
                    help="the cluster's replication: async expects losses, all found by the books")
    ap.add_argument("--provider", required=True)
    ap.add_argument("--token-file", action="append", required=True, help="NAME=FILE")
    ap.add_argument("--cluster", required=True)
    ap.add_argument("--faults", default="switchover,kill-primary,freeze,kill-node,switchover,kill-primary,freeze,kill-node")
    ap.add_argument("--rate", type=float, default=20.0, help="payments per second, all merchants")
    ap.add_argument("--threads", type=int, default=4, help="per merchant")
    ap.add_argument("--gap", type=float, default=10.0, help="quiet seconds before each fault")
    ap.add_argument("--freeze", type=int, default=25)
    ap.add_argument("--node-down", type=int, default=30, help="past the leader key's TTL (20 s), so a replica takes over")
    ap.add_argument("--tail", type=float, default=10.0)
    ap.add_argument("--give-up", type=float, default=180.0)
    ap.add_argument("--settle", type=float, default=300.0,
                    help="seconds the worker and the reconciler get to settle every payment after the load")
    ap.add_argument("--no-provider-faults", action="store_true", help="a provider that never fails")
    ap.add_argument("--report", help="write the figures as JSON here")
    ap.add_argument("--status-log", help="append the cluster's status around each fault here")
    args = ap.parse_args()
    args.run = uuid.uuid4().hex[:8]
    tokens = {}
    for item in args.token_file:
        name, path = item.split("=", 1)
        with open(path) as f:
            tokens[name] = f.read().strip()

    if not args.no_provider_faults:
        for rule in PROVIDER_FAULTS:
            status, _, answer = request("POST", f"{args.provider}/__admin/faults", body=rule)
            assert status in (200, 201), f"fault {rule}: {status} {answer}"
    threads = []
    per_thread = len(tokens) * args.threads / args.rate
    for merchant, token in tokens.items():
        # Twins: every merchant counts from 0, so both send the same keys
        # and order refs.
        counter = itertools.count()
        for _ in range(args.threads):
            t = threading.Thread(target=merchant_thread, args=(args, merchant, token, counter, per_thread), daemon=True)
            t.start()
            threads.append(t)
    started = time.time()
    faults = run_faults(args)
    time.sleep(args.tail)
    STOP.set()
    for t in threads:
        t.join(args.give_up + 35)
    load_s = time.time() - started
    # After the merchants' last retries: an outage that outlasted the
    # load ends with the commits of those retries.
    commits = measure(faults, time.time())

    found = settle(args, tokens)
    status, _, ledger = request("GET", f"{args.provider}/__admin/ledger")
    assert status == 200, f"ledger: {status}"
    books_report, orphans = books(args, started)
    lossy = args.mode == "async"

    failures = []
    acked = [p for p in PAYMENTS if p["ok_at"] is not None]
    for p in PAYMENTS:
        if p["ok_at"] is None:
            failures.append(f"{p['merchant']} {p['key']}: no 2xx ({p.get('final') or 'gave up'}; {p['statuses'][-5:]})")
    ids_by_merchant = {m: set() for m in tokens}
    lost = []
    for p in acked:
        if len(p["ids"]) != 1:
            failures.append(f"{p['merchant']} {p['key']}: answers named {len(p['ids'])} payments")
        for pid in p["ids"]:
            ids_by_merchant[p["merchant"]].add(pid)
            body = found.get(pid)
            if body is None:
                lost.append((p, pid))
                if not lossy:
                    failures.append(f"{p['merchant']} {p['key']}: payment {pid} (answered 2xx) does not exist")
            elif body["order_ref"] != p["order_ref"] or body["amount"] != p["amount"]:
                failures.append(f"{p['merchant']} {p['key']}: payment {pid} is not what was asked")
    unsettled = [pid for pid, b in found.items() if b and b["status"] in ("processing", "requires_reconciliation")]
    for pid in unsettled:
        failures.append(f"payment {pid} did not converge ({found[pid]['status']})")
    statuses = {}
    for b in found.values():
        if b:
            statuses[b["status"]] = statuses.get(b["status"], 0) + 1

    account_of = {}
    for merchant, token in tokens.items():
        for pid in ids_by_merchant[merchant]:
            account_of[pid] = merchant
    charges = [c for c in ledger["charges"] if c["status"] != "declined"]
    per_intent = {}
    untraced = 0
    found_by_books = 0
    for c in charges:
        meta = c.get("metadata", {})
        intent = (meta.get("cobro_account"), meta.get("cobro_intent"))
        per_intent.setdefault(intent, []).append(c["id"])
        pid = meta.get("cobro_payment")
        body = found.get(pid)
        if pid not in account_of or body is None or body.get("provider_ref") != c["id"]:
            untraced += 1
            if lossy and c["id"] in orphans:
                found_by_books += 1
            else:
                failures.append(f"charge {c['id']} ({c['reference']}): not traced to a merchant's payment "
                                f"with that provider_ref{' nor found by the books' if lossy else ''}")
    twice = {k: v for k, v in per_intent.items() if len(v) > 1}
    for (account, intent), ids in twice.items():
        # Asynchronous: a lost payment's charge, then the retry's: the
        # books must hold all but one of them as orphans.
        if not (lossy and sum(i in orphans for i in ids) >= len(ids) - 1):
            failures.append(f"intent {intent} of account {account} charged {len(ids)} times")
    books_counts = {k: sum(r["counts"].get(k, 0) for r in books_report.get("runs", []))
                    for k in ("objects", "matched", "orphan", "foreign", "drifted", "missing")}
    if books_counts["missing"]:
        failures.append(f"the books found {books_counts['missing']} payments missing at the provider")
    if not lossy and orphans:
        failures.append(f"the books found {len(orphans)} orphans: {sorted(orphans)[:5]}")
    charged = {c.get("metadata", {}).get("cobro_payment") for c in charges}
    lost_charged = [pid for (_, pid) in lost if pid in charged]
    if ledger.get("duplicate_charge_references"):
        failures.append(f"ledger duplicate_charge_references: {ledger['duplicate_charge_references']}")
    codes = {}
    for (_, _, st, _) in ATTEMPTS:
        codes[str(st)] = codes.get(str(st), 0) + 1
    if codes.get("500"):
        failures.append(f"{codes['500']} answers were 500")

    figures = [f["unavailable_s"] for f in faults if f["unavailable_s"] is not None]
    summary = {
        "load_seconds": round(load_s, 1),
        "payments_started": len(PAYMENTS),
        "payments_acknowledged": len(acked),
        "attempts_by_status": codes,
        "payments_by_status_at_end": statuses,
        "unsettled_at_end": len(unsettled),
        "provider_charges": len(charges),
        "intents_charged_twice": len(twice),
        "untraced_charges": untraced,
        "mode": args.mode,
        "acknowledged_lost": len(lost),
        "acknowledged_lost_with_a_charge": len(lost_charged),
        "untraced_charges_found_by_the_books": found_by_books,
        "books": books_counts,
        "books_orphans": len(orphans),
        "faults": faults,
        "unavailability_median_s": round(statistics.median(figures), 1) if figures else None,
        "unavailability_worst_s": round(max(figures), 1) if figures else None,
        "failures": failures[:50],
        "failure_count": len(failures),
    }
    print(json.dumps(summary, indent=2))
    if args.report:
        with open(args.report, "w") as f:
            # The raw timeline too (commit answer times, each fault's t0),
            # so the figures can be recomputed another way.
            json.dump({**summary, "failures": failures, "commit_times": commits}, f, indent=2)
    print("\nfault          node  no commit for  writes back after", file=sys.stderr)
    for f in faults:
        value = "never" if f["unavailable_s"] is None else f"{f['unavailable_s']:.1f} s"
        back = "never" if f["unavailable_s"] is None else f"{f['back_after_s']:.1f} s"
        print(f"{f['fault']:<14} {f['leader']:<5} {value:<14} {back}", file=sys.stderr)
    print(f"median {summary['unavailability_median_s']} s, worst {summary['unavailability_worst_s']} s; "
          f"{len(acked)}/{len(PAYMENTS)} payments acknowledged, {len(charges)} charges, "
          f"{len(twice)} intents charged twice, {untraced} untraced charges "
          f"({found_by_books} of them orphans in the books), {len(lost)} acknowledged lost "
          f"({len(lost_charged)} with a charge), {len(unsettled)} unsettled; books {books_counts}; "
          f"answers {codes}", file=sys.stderr)
    if failures:
        print(f"chaos: FAILED ({len(failures)}): " + "; ".join(failures[:10]), file=sys.stderr)
        return 1
    print("chaos: passed", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
