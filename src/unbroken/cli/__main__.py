"""``python -m unbroken.cli``."""

from . import main

main()
