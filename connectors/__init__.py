"""Adapters from data engines (Ray Data, Spark) to the batchgen engine.

Heavy imports (ray, pyspark) stay inside the submodules that need them, so importing this
package costs nothing.
"""
