#!/usr/bin/python
"""The service tiers' QOS and the accounts' GPU-hour caps in Slurm's accounting, set with sacctmgr."""

from __future__ import annotations

DOCUMENTATION = r"""
module: slurm_limits
short_description: Keep Slurm's tier QOS and accounts' limits as the inventory says
description:
  - Reads the QOS and the accounts' associations from slurmdbd (sacctmgr), and sets what differs
    from the wanted state; nothing is set where nothing differs.
  - In check mode nothing is set; what would be is reported as changed, with a diff (a cap raised
    by hand, a QOS whose priority was edited: the drift a site's check run is for).
  - The tiers' QOS are added to those the root association of the cluster allows (a site's own
    stay), so every account and user inherits them. A cap is GrpTRESMins=gres/gpu (GPU-minutes,
    rounded down: Slurm's usage, reset monthly with PriorityUsageResetPeriod=MONTHLY); concurrent runs
    GrpJobs. An account without a cap or limit has it cleared (-1).
  - Names are kept lowercase, as slurmdbd keeps them; a name sacctmgr would read as a list or a
    condition, a cap that is not a number of 0 or more, fails the task before anything is set.
  - slurmctld registers gres/gpu with slurmdbd as it starts; a cap set before that is refused, so
    a refused set is tried again for up to I(wait) seconds.
options:
  cluster:
    description: The cluster's name in slurmdbd (ClusterName).
    required: true
    type: str
  qos:
    description: The tiers' QOS, each with I(name) and I(priority).
    type: list
    elements: dict
    default: []
  accounts:
    description: Accounts, each with I(name) and optional I(cap_gpu_hours) and I(max_running_jobs).
    type: list
    elements: dict
    default: []
  wait:
    description: Seconds to keep trying a set that slurmdbd refuses (a TRES not yet registered).
    type: float
    default: 30
author: ft
"""

import math
import re
import time

SACCTMGR = ["sacctmgr", "--noheader", "--parsable2"]
# Names as slurmdbd keeps them (lowercase); nothing sacctmgr would read as a list (",") or a
# condition ("=", a space).
NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")


class Invalid(ValueError):
    """The inventory asks for what cannot be set: said as the task's failure, never a traceback."""


def checked(qos, accounts):
    """The inventory's tiers and accounts, validated and in slurmdbd's words (names lowercase, the cap
    in whole GPU-minutes rounded down: never looser than the hours asked)."""
    tiers = []
    for tier in qos:
        name = str(tier.get("name", "")).lower()
        if not NAME.fullmatch(name):
            raise Invalid(f"QOS name {tier.get('name')!r}: use letters, digits, '.', '_' and '-'")
        tiers.append({"name": name, "priority": whole(tier.get("priority"), f"QOS {name}: priority")})
    found = []
    for account in accounts:
        name = str(account.get("name", "")).lower()
        if not NAME.fullmatch(name):
            raise Invalid(f"account name {account.get('name')!r}: use letters, digits, '.', '_' and '-'")
        hours = account.get("cap_gpu_hours")
        if hours is not None:
            try:
                hours = float(hours)
            except (TypeError, ValueError):
                raise Invalid(f"account {name}: cap_gpu_hours {hours!r} is not a number") from None
            if not math.isfinite(hours) or hours < 0:
                raise Invalid(f"account {name}: cap_gpu_hours {hours!r} must be 0 or more")
        jobs = account.get("max_running_jobs")
        found.append({"name": name, "cap_minutes": "" if hours is None else str(math.floor(hours * 60 + 1e-9)),
                      "max_running_jobs": "" if jobs is None else whole(jobs, f"account {name}: max_running_jobs")})
    return tiers, found


def whole(value, what):
    """A count or priority: a whole number, 0 or more ("20" and 20.0 are 20)."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise Invalid(f"{what} {value!r} is not a number") from None
    if not math.isfinite(number) or number < 0 or number != int(number):
        raise Invalid(f"{what} {value!r} must be a whole number, 0 or more")
    return str(int(number))


def parse_qos(text):
    """`show qos format=name,priority` -> {name: priority}."""
    found = {}
    for line in text.splitlines():
        name, _, priority = line.partition("|")
        if name:
            found[name] = priority
    return found


def parse_accounts(text):
    """`show associations format=account,user,qos,grptresmins,grpjobs` -> each account's own
    association (no user): {account: {"qos": [...], "cap_minutes": str, "max_running_jobs": str}}."""
    found = {}
    for line in text.splitlines():
        fields = line.split("|")
        if len(fields) < 5 or fields[1]:
            continue
        account, _, qos, tres_minutes, jobs = fields[:5]
        cap = [item.split("=", 1)[1] for item in tres_minutes.split(",") if item.startswith("gres/gpu=")]
        found[account] = {"qos": sorted(q for q in qos.split(",") if q), "cap_minutes": cap[0] if cap else "",
                          "max_running_jobs": jobs}
    return found


def plan(cluster, qos_state, accounts_state, qos, accounts):
    """The sacctmgr calls that make the state the wanted one: [(what, argv)], in order. `qos` and
    `accounts` as checked() gives them."""
    changes = []
    for tier in qos:
        name, priority = tier["name"], tier["priority"]
        if name not in qos_state:
            changes.append((f"create QOS {name} (priority {priority})",
                            ["sacctmgr", "--immediate", "add", "qos", name, f"priority={priority}"]))
        elif qos_state[name] != priority:
            changes.append((f"QOS {name}: priority {qos_state[name]} -> {priority}",
                            ["sacctmgr", "--immediate", "modify", "qos", "where", f"name={name}", "set",
                             f"priority={priority}"]))
    missing = sorted({"normal", *(tier["name"] for tier in qos)} - set(accounts_state.get("root", {}).get("qos", [])))
    if qos and missing:  # added to what root allows: a site's own QOS there stay
        changes.append((f"every association may use {','.join(missing)}",
                        ["sacctmgr", "--immediate", "modify", "account", "where", "name=root",
                         f"cluster={cluster}", "set", f"qos+={','.join(missing)}"]))
    for account in accounts:
        name = account["name"]
        held = accounts_state.get(name, {"cap_minutes": "", "max_running_jobs": ""})
        cap, jobs = account["cap_minutes"], account["max_running_jobs"]
        if (held["cap_minutes"], held["max_running_jobs"]) != (cap, jobs):
            changes.append((f"account {name}: GPU-minutes cap {held['cap_minutes'] or 'none'} -> {cap or 'none'}, "
                            f"running jobs {held['max_running_jobs'] or 'any'} -> {jobs or 'any'}",
                            ["sacctmgr", "--immediate", "modify", "account", "where", f"name={name}",
                             f"cluster={cluster}", "set", f"GrpTRESMins=gres/gpu={cap or -1}",
                             f"GrpJobs={jobs or -1}"]))
    return changes


def describe(qos_state, accounts_state, names):
    """The state as text, for a diff: the QOS, root's QOS and the named accounts' limits."""
    lines = [f"qos {name}: priority {priority}" for name, priority in sorted(qos_state.items())]
    lines.append(f"root may use: {','.join(accounts_state.get('root', {}).get('qos', []))}")
    for name in sorted(names):
        held = accounts_state.get(name, {})
        lines.append(f"account {name}: GrpTRESMins=gres/gpu={held.get('cap_minutes') or 'none'} "
                     f"GrpJobs={held.get('max_running_jobs') or 'none'}")
    return "\n".join(lines) + "\n"


def wanted_state(qos_state, accounts_state, qos, accounts):
    """The state once the plan is carried out (for the diff's after)."""
    qos_after = dict(qos_state) | {tier["name"]: tier["priority"] for tier in qos}
    accounts_after = {name: dict(value) for name, value in accounts_state.items()}
    if qos:
        root = accounts_after.setdefault("root", {})
        root["qos"] = sorted({*root.get("qos", []), "normal", *(tier["name"] for tier in qos)})
    for account in accounts:
        accounts_after.setdefault(account["name"], {}).update(
            {"cap_minutes": account["cap_minutes"], "max_running_jobs": account["max_running_jobs"]})
    return qos_after, accounts_after


def read(module, cluster):
    rc, qos_text, err = module.run_command(SACCTMGR + ["show", "qos", "format=name,priority"])
    if rc != 0:
        module.fail_json(msg=f"sacctmgr show qos failed: {err.strip()}")
    rc, assoc_text, err = module.run_command(
        SACCTMGR + ["show", "associations", f"cluster={cluster}", "format=account,user,qos,grptresmins,grpjobs"])
    if rc != 0:
        module.fail_json(msg=f"sacctmgr show associations failed: {err.strip()}")
    return parse_qos(qos_text), parse_accounts(assoc_text)


def carry_out(module, what, argv, wait):
    deadline = time.monotonic() + wait
    while True:
        rc, out, err = module.run_command(argv)
        if rc == 0:
            return
        if time.monotonic() >= deadline:
            module.fail_json(msg=f"{what}: sacctmgr failed: {(err or out).strip()}", argv=argv)
        time.sleep(2)


def main():
    # Imported here, not at the top: the planning functions above are imported by unit tests, and
    # ansible's module_utils patch sys.intern process-wide, which torch's compiler then trips on.
    from ansible.module_utils.basic import AnsibleModule

    module = AnsibleModule(
        argument_spec={
            "cluster": {"type": "str", "required": True},
            "qos": {"type": "list", "elements": "dict", "default": []},
            "accounts": {"type": "list", "elements": "dict", "default": []},
            "wait": {"type": "float", "default": 30.0},
        },
        supports_check_mode=True,
    )
    params = module.params
    if not NAME.fullmatch(params["cluster"]):
        module.fail_json(msg=f"cluster name {params['cluster']!r}: use letters, digits, '.', '_' and '-'")
    try:
        qos, accounts = checked(params["qos"], params["accounts"])
    except Invalid as exc:
        module.fail_json(msg=str(exc))
    qos_state, accounts_state = read(module, params["cluster"])
    changes = plan(params["cluster"], qos_state, accounts_state, qos, accounts)
    names = [account["name"] for account in accounts]
    qos_after, accounts_after = wanted_state(qos_state, accounts_state, qos, accounts)
    diff = {"before": describe(qos_state, accounts_state, names),
            "after": describe(qos_after, accounts_after, names)}
    if not module.check_mode:
        for what, argv in changes:
            carry_out(module, what, argv, params["wait"])
    module.exit_json(changed=bool(changes), changes=[what for what, _ in changes], diff=diff)


if __name__ == "__main__":
    main()
