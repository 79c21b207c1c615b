"""Load testing and simulation for kvroute: the simulated engine fleet, trace replay, benchmarks."""
