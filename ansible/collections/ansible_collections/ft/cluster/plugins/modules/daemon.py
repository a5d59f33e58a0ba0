#!/usr/bin/python
"""Start or stop a daemon on a host without systemd, optionally inside a lab node namespace."""

from __future__ import annotations

DOCUMENTATION = r"""
module: daemon
short_description: Keep a daemon running (or stopped) where systemd is not available
description:
  - Idempotent start/stop of a self-daemonizing program tracked by its pid file.
  - A pid file is trusted only when its PID is alive, runs the expected executable and, for a
    namespaced daemon, lives in the expected network namespace; stale pid files are replaced.
  - With I(netns) and I(hostname) the daemon is started in that network namespace under its own
    UTS hostname (nsenter + unshare), which is how ft's local lab gives every node its own host.
  - Real clusters use systemd instead; roles pick this module only where systemd does not run.
options:
  name:
    description: Label used in messages.
    required: true
    type: str
  argv:
    description: Command line; the first element is the executable's absolute path.
    required: true
    type: list
    elements: str
  pidfile:
    description: Pid file the daemon writes.
    required: true
    type: path
  state:
    description: Wanted state.
    choices: [started, stopped, restarted]
    default: started
    type: str
  netns:
    description: Name of a network namespace under /run/netns.
    type: str
  hostname:
    description: UTS hostname to run under (a private UTS namespace).
    type: str
  user:
    description: User to run as, for daemons that do not drop privileges themselves.
    type: str
  process_name:
    description: Basename of the running executable when it differs from the first argv element (init scripts).
    type: str
  listen_port:
    description: TCP port the daemon must listen on before it counts as started.
    type: int
  replaces:
    description:
      - Executables of other builds of the same daemon (another version of it). One of them running
        behind the pid file is stopped, with state started (then the daemon starts) or stopped.
    type: list
    elements: path
    default: []
  config_files:
    description: Files the daemon reads at start; a daemon started before one of them last changed is restarted.
    type: list
    elements: path
    default: []
  timeout:
    description: Seconds to wait for the pid file, the port, or the exit.
    type: float
    default: 30
author: ft
"""

EXAMPLES = r"""
- name: Start slurmd for lab node node1
  ft.cluster.daemon:
    name: slurmd node1
    argv: [/usr/sbin/slurmd]
    pidfile: /run/slurm/slurmd-node1.pid
    netns: ftlab-node1
    hostname: node1
"""

RETURN = r"""
pid: {description: PID of the running daemon (absent when stopped)., returned: success, type: int}
"""

import os
import pwd
import signal
import subprocess
import tempfile
import time

from ansible.module_utils.basic import AnsibleModule

NETNS_DIR = "/run/netns"


def read_pid(pidfile):
    try:
        with open(pidfile) as handle:
            return int(handle.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def same_netns(pid, netns):
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino == os.stat(os.path.join(NETNS_DIR, netns)).st_ino
    except OSError:
        return False


def runs_program(exe, params):
    """Whether a process executable is the daemon's (guards against a reused PID)."""
    exe = exe.removesuffix(" (deleted)")  # the package was upgraded under a running daemon
    if params["process_name"]:
        return os.path.basename(exe) == params["process_name"]
    # Debian installs /usr/sbin/slurmctld as an alternatives link to slurmctld-wlm.
    return exe == os.path.realpath(params["argv"][0])


def running_pid(params, program=runs_program):
    """The daemon's PID if its pid file names a live process of the right program, else None."""
    pid = read_pid(params["pidfile"])
    if pid is None:
        return None
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return None  # dead, or a PID we may not inspect: treat as stale
    if not program(exe, params):
        return None  # the PID was reused by another program
    if params["netns"] and not same_netns(pid, params["netns"]):
        return None
    return pid


def runs_replaced(exe, params):
    """Whether a process executable is another build of the daemon (`replaces`)."""
    exe = exe.removesuffix(" (deleted)")
    return exe != os.path.realpath(params["argv"][0]) and \
        exe in {os.path.realpath(path) for path in params["replaces"]}


def started_at(pid):
    """Wall-clock start time of a process (seconds since the epoch, about 1 s precision)."""
    with open(f"/proc/{pid}/stat") as handle:
        # The command name may hold spaces and parentheses: fields start after the last ")".
        fields = handle.read().rsplit(")", 1)[1].split()
    start_ticks = int(fields[19])
    with open("/proc/stat") as handle:
        boot_time = next(int(line.split()[1]) for line in handle if line.startswith("btime "))
    return boot_time + start_ticks / os.sysconf("SC_CLK_TCK")


def outdated(pid, config_files):
    """True when a config file changed after the daemon started (it runs on an old config)."""
    start = started_at(pid)
    for path in config_files:
        try:
            if os.stat(path).st_mtime > start + 1.0:  # 1 s: the precision of the boot time
                return True
        except FileNotFoundError:
            continue
    return False


def listening(port, netns):
    """True when something listens on TCP `port` (read from /proc, never by connecting)."""
    command = ["ss", "-Hltn", f"sport = :{port}"]
    if netns:
        command = ["nsenter", f"--net={NETNS_DIR}/{netns}"] + command
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    return bool(result.stdout.strip())


def launch_command(params):
    argv = list(params["argv"])
    if params["hostname"]:
        # A private UTS namespace so the daemon sees its own hostname (slurmd takes its node name
        # from it). `ip netns exec` is avoided on purpose: it remounts /sys and slurmd then fails.
        argv = ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', params["hostname"]] + argv
    if params["netns"]:
        argv = ["nsenter", f"--net={NETNS_DIR}/{params['netns']}"] + argv
    return argv


def drop_privileges(user):
    entry = pwd.getpwnam(user)

    def switch():
        os.initgroups(user, entry.pw_gid)
        os.setgid(entry.pw_gid)
        os.setuid(entry.pw_uid)

    return switch


def wait_until(predicate, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def start(module, params):
    if params["netns"] and not os.path.exists(os.path.join(NETNS_DIR, params["netns"])):
        module.fail_json(msg=f"{params['name']}: network namespace {params['netns']} does not exist")
    pidfile = params["pidfile"]
    if os.path.exists(pidfile):
        os.unlink(pidfile)  # stale: running_pid() said nobody lives behind it
    # stderr goes to a file, not a pipe: a daemon that keeps the descriptor would hold a pipe open.
    with open(os.devnull, "rb") as devnull_in, open(os.devnull, "wb") as devnull_out, \
            tempfile.TemporaryFile() as stderr:
        process = subprocess.Popen(
            launch_command(params),
            stdin=devnull_in,
            stdout=devnull_out,
            stderr=stderr,
            start_new_session=True,
            preexec_fn=drop_privileges(params["user"]) if params["user"] else None,
        )
        # Self-daemonizing programs return once they have forked; non-zero means they failed.
        try:
            status = process.wait(timeout=params["timeout"])
        except subprocess.TimeoutExpired:
            status = None
        stderr.seek(0)
        message = stderr.read().decode(errors="replace").strip()
    if status not in (0, None):
        module.fail_json(msg=f"{params['name']} failed to start (exit {status}): {message}")
    if not wait_until(lambda: running_pid(params) is not None, params["timeout"]):
        module.fail_json(msg=f"{params['name']} did not write a live pid to {pidfile} within "
                             f"{params['timeout']} s; see its log file")
    if params["listen_port"] and not wait_until(
            lambda: listening(params["listen_port"], params["netns"]), params["timeout"]):
        module.fail_json(msg=f"{params['name']} is running but not listening on port "
                             f"{params['listen_port']} after {params['timeout']} s")
    return running_pid(params)


def stop(module, params, pid):
    os.kill(pid, signal.SIGTERM)
    if not wait_until(lambda: not os.path.exists(f"/proc/{pid}"), params["timeout"]):
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: not os.path.exists(f"/proc/{pid}"), 5)
    if os.path.exists(params["pidfile"]) and read_pid(params["pidfile"]) == pid:
        os.unlink(params["pidfile"])


def main():
    module = AnsibleModule(
        argument_spec={
            "name": {"type": "str", "required": True},
            "argv": {"type": "list", "elements": "str", "required": True},
            "pidfile": {"type": "path", "required": True},
            "state": {"type": "str", "default": "started", "choices": ["started", "stopped", "restarted"]},
            "netns": {"type": "str"},
            "hostname": {"type": "str"},
            "user": {"type": "str"},
            "process_name": {"type": "str"},
            "listen_port": {"type": "int"},
            "replaces": {"type": "list", "elements": "path", "default": []},
            "config_files": {"type": "list", "elements": "path", "default": []},
            "timeout": {"type": "float", "default": 30.0},
        },
        supports_check_mode=True,
    )
    params = module.params
    pid = running_pid(params)
    state = params["state"]
    replaced = running_pid(params, runs_replaced) if pid is None else None
    if replaced is not None:  # another build of the daemon (a version change): it goes first
        if not module.check_mode:
            stop(module, params, replaced)
        if state == "stopped" or module.check_mode:
            module.exit_json(changed=True)
    if state == "started" and pid is not None and outdated(pid, params["config_files"]):
        state = "restarted"
    if state == "started" and pid is not None:
        module.exit_json(changed=False, pid=pid)
    if state == "stopped" and pid is None:
        module.exit_json(changed=False)
    if module.check_mode:
        module.exit_json(changed=True)
    if pid is not None:
        stop(module, params, pid)
    if state == "stopped":
        module.exit_json(changed=True)
    module.exit_json(changed=True, pid=start(module, params))


if __name__ == "__main__":
    main()
