"""Private helpers every layer may use (layer 0): the console's log format (``console``), progress bars
(``progress``), exit hooks that run while thread pools still work (``exithooks``), and the named fault points
the tests inject failures at (``faultpoints``, ``UNBROKEN_FAULTS``). Nothing here knows about checkpoints."""
