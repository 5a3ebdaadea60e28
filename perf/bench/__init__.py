"""The scenario harness: topology starts pinned pdserve processes and reads their counters;
compare turns side-by-side runs into verdicts against targets. The benchmark client itself is
pdserve.services.control.bench (`pdserve bench`), which users get with the package.
"""
