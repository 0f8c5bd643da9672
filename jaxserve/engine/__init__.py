"""The serving engine: scheduler and cache bookkeeping on the host, one jitted step on the device.

``pools`` sizes and allocates the device pools (paged KV, linear-state slots); ``runner`` turns a
host plan into a padded ``Batch`` and runs the bucketed, pool-donating step.
"""
