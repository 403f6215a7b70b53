"""`python -m moe_ops.bench`: an alias of the `moe-ops-bench` console script
(moe_ops.tools.bench)."""
if __name__ == "__main__":
    import sys

    from moe_ops.tools.bench import main

    sys.exit(main())
