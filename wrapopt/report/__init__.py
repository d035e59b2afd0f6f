"""report: text tables, JSON views and pictures of graphs, plans and fabrics."""

from wrapopt.report.fabric import format_fabric
from wrapopt.report.pareto import PlanPoint, draw_pareto
from wrapopt.report.plots import TimelinePanel, draw_timeline, draw_timelines
from wrapopt.report.text import format_graph, format_plan, graph_to_json

__all__ = ["format_graph", "graph_to_json", "format_plan", "format_fabric", "draw_timeline", "draw_timelines",
           "draw_pareto", "TimelinePanel", "PlanPoint"]
