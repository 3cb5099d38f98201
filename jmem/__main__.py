"""`python -m jmem ...`: the same as the `jmem` command (`jmem serve`, `jmem generate`, `jmem info`, ...)."""

from jmem.cli import main

if __name__ == "__main__":
    main()
