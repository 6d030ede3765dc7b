"""MegaDPP: dynamic pipeline policies, a discrete-event pipeline simulator, schedule pictures, the `dpp` CLI."""
