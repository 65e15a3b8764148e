"""The lab: what the project uses to study STARE on a CPU, apart from the trainer itself.

Synthetic tool tasks (tasks), the toy simulation (simulate), tiny models built offline (models), the quickstart
and experiment pipelines with their reports (quickstart, experiment, results, report, runs), statistics, plots,
and the analysis tools (analysis/, `stare-agent lab TOOL`). It builds on the product core and the backends;
nothing outside the lab imports it except the command line (an import test checks).
"""
