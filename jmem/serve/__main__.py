"""`python -m jmem.serve ...`: the same as `jmem serve ...`."""

from jmem.serve.cli import serve_main

if __name__ == "__main__":
    serve_main()
