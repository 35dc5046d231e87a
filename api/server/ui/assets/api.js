// The REST API, called with the signed-in key. The key lives in
// sessionStorage: it survives a reload but not the tab, and other tabs and
// later visits never see it (localStorage would keep it on disk for good).

const KEY = "kc.apiKey";

export class ApiError extends Error {
  constructor(status, detail) {
    super(describe(status, detail));
    this.status = status;
    this.detail = detail;
  }
}

export class AuthError extends ApiError {}

let onUnauthorized = () => {};

/** Called with the server's message whenever a request answers 401. */
export function setUnauthorizedHandler(fn) { onUnauthorized = fn; }

export const getKey = () => window.sessionStorage.getItem(KEY);
export const setKey = (key) => window.sessionStorage.setItem(KEY, key);
export const clearKey = () => window.sessionStorage.removeItem(KEY);

/** One message for an error body: `detail` as a string, or its first entry. */
function describe(status, detail) {
  if (typeof detail === "string") return detail;
  if (Array.isArray(detail) && detail.length) {
    const d = detail[0];
    return d.field ? `${d.field}: ${d.msg}` : String(d.msg);
  }
  return `the server answered ${status}`;
}

/**
 * Call the API; the parsed JSON, or ApiError with the answer's `detail`.
 * A body that is not JSON (a proxy's error page, say) is never shown: the
 * message then only names the status.
 */
export async function api(path, {method = "GET", body, type = "application/json"} = {}) {
  const headers = {Accept: "application/json"};
  const key = getKey();
  if (key) headers.Authorization = `Bearer ${key}`;
  if (body !== undefined) headers["Content-Type"] = type;
  let resp;
  try {
    resp = await fetch(path, {method, headers, body, cache: "no-store", credentials: "omit"});
  } catch (exc) {
    throw new ApiError(0, `the API server cannot be reached (${exc.message})`);
  }
  let data = null;
  if ((resp.headers.get("content-type") || "").includes("json")) {
    try { data = await resp.json(); } catch { data = null; }
  }
  if (resp.status === 401) {
    const err = new AuthError(401, data && data.detail);
    onUnauthorized(err.message);
    throw err;
  }
  if (!resp.ok) throw new ApiError(resp.status, data && data.detail);
  return {status: resp.status, data};
}

/** GET and return the JSON body. */
export async function get(path) {
  return (await api(path)).data;
}

export const enc = encodeURIComponent;
