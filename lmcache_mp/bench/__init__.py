"""`lmcache-mp-bench`: measure a server on this machine against its bounds and a Redis peer."""
