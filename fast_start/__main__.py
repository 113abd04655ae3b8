"""`python -m fast_start`: the `fast-start` command line."""
from .cli import main

main()
