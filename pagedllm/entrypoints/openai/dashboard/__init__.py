"""The live dashboard at /dashboard: a static page (index.html, dashboard.js, shipped as package
data, no CDN) that polls /dashboard/state."""

from pagedllm.entrypoints.openai.dashboard.routes import add_dashboard_routes

__all__ = ["add_dashboard_routes"]
