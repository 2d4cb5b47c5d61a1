"""Deployments of the intone server on other systems (Ray Serve: `intone.deploy.ray`)."""
