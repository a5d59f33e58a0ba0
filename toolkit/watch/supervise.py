"""The entry a job script rendered by an older ft runs (`python -m toolkit.watch.supervise -- srun
...`): a job requeued across an upgrade of ft reruns the script it was submitted with. The
supervisor lives in the job's own package now (toolkit/job/supervise.py); this name stays for those
scripts, and imports it only when run (nothing in watch/ may import the job above it)."""

if __name__ == "__main__":
    import sys

    from toolkit.job.supervise import main

    sys.exit(main(sys.argv[1:]))
