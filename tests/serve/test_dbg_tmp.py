import sys; sys.path.insert(0, "tests/serve"); from test_openai_app import *
def test_dbg(engine, url):
    tight = f"{url}/tight"
    held = _open_stream(tight, {})
    for i in range(5):
        print(requests.get(f"{tight}/health").json(), ray.get(engine.stats.remote())["coordinator"])
        time.sleep(0.2)
    held.close()
