"""What finished loads say: their SQLite store (store.py), the histograms of this run
(histograms.py), a restart's forecast (forecast.py), a load's report against the ones before it
(explain.py), the startupProbe window (startupwindow.py) and one target's past in one view
(targethistory.py).
"""
