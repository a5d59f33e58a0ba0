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
  - The tiers' QOS are allowed on the root association of the cluster, so every account and user
    inherits them. A cap is GrpTRESMins=gres/gpu (GPU-minutes: Slurm's usage, reset monthly with
    PriorityUsageResetPeriod=MONTHLY); concurrent runs GrpJobs. An account without a cap or limit
    has it cleared (-1).
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

import time

SACCTMGR = ["sacctmgr", "--noheader", "--parsable2"]


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


def cap_minutes(account):
    """The cap as Slurm holds it: GPU-minutes ("" where none)."""
    hours = account.get("cap_gpu_hours")
    return "" if hours is None else str(int(round(float(hours) * 60)))


def running_jobs(account):
    """The limit of running jobs as Slurm holds it ("" where none)."""
    jobs = account.get("max_running_jobs")
    return "" if jobs is None else str(int(jobs))


def plan(cluster, qos_state, accounts_state, qos, accounts):
    """The sacctmgr calls that make the state the wanted one: [(what, argv)], in order."""
    changes = []
    for tier in qos:
        name, priority = tier["name"], str(tier["priority"])
        if name not in qos_state:
            changes.append((f"create QOS {name} (priority {priority})",
                            ["sacctmgr", "--immediate", "add", "qos", name, f"priority={priority}"]))
        elif qos_state[name] != priority:
            changes.append((f"QOS {name}: priority {qos_state[name]} -> {priority}",
                            ["sacctmgr", "--immediate", "modify", "qos", "where", f"name={name}", "set",
                             f"priority={priority}"]))
    tier_qos = sorted({"normal", *(tier["name"] for tier in qos)})
    if qos and accounts_state.get("root", {}).get("qos") != tier_qos:
        changes.append((f"every association may use {','.join(tier_qos)}",
                        ["sacctmgr", "--immediate", "modify", "account", "where", "name=root",
                         f"cluster={cluster}", "set", f"qos={','.join(tier_qos)}"]))
    for account in accounts:
        name = account["name"].lower()
        held = accounts_state.get(name, {"cap_minutes": "", "max_running_jobs": ""})
        cap, jobs = cap_minutes(account), running_jobs(account)
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
    qos_after = dict(qos_state) | {tier["name"]: str(tier["priority"]) for tier in qos}
    accounts_after = {name: dict(value) for name, value in accounts_state.items()}
    if qos:
        accounts_after.setdefault("root", {})["qos"] = sorted({"normal", *(tier["name"] for tier in qos)})
    for account in accounts:
        accounts_after.setdefault(account["name"].lower(), {}).update(
            {"cap_minutes": cap_minutes(account), "max_running_jobs": running_jobs(account)})
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
    qos_state, accounts_state = read(module, params["cluster"])
    changes = plan(params["cluster"], qos_state, accounts_state, params["qos"], params["accounts"])
    names = [account["name"].lower() for account in params["accounts"]]
    qos_after, accounts_after = wanted_state(qos_state, accounts_state, params["qos"], params["accounts"])
    diff = {"before": describe(qos_state, accounts_state, names),
            "after": describe(qos_after, accounts_after, names)}
    if not module.check_mode:
        for what, argv in changes:
            carry_out(module, what, argv, params["wait"])
    module.exit_json(changed=bool(changes), changes=[what for what, _ in changes], diff=diff)


if __name__ == "__main__":
    main()
